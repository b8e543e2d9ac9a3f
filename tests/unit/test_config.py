"""Options are checked up front, each bad value named."""

from __future__ import annotations

import math

import pytest

from tokpipe_compiler.config import MAX_TIMEOUT, Config


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0, 1e10, True, "5"])
def test_bad_timeouts_are_named(timeout):
    with pytest.raises(ValueError, match="option 'timeout' must be a finite number of seconds"):
        Config(timeout=timeout)


@pytest.mark.parametrize("timeout", [0.5, 5, MAX_TIMEOUT])
def test_good_timeouts(timeout):
    assert Config(timeout=timeout).timeout == timeout


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"unknown tokpipe option\(s\) \['stagse'\]"):
        Config.from_options({"stagse": 2})


def test_an_unknown_attention_kernel_is_named():
    with pytest.raises(ValueError, match=r"option 'attention'.*'sdpa'.*'triton'.*'flash'"):
        Config(attention="flash")
