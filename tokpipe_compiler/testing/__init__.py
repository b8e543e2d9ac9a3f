"""Check a model's pipelined run against eager PyTorch, in your own test suite.

    from tokpipe_compiler.testing import assert_equivalent, latents_like, options

`assert_equivalent` and its report types live in `equivalence`, where a run first goes wrong
in `locate`, hypothesis strategies in `strategies` (imported on first use: hypothesis is a
test-only dependency).
"""

from __future__ import annotations

from typing import Any

from tokpipe_compiler.testing.equivalence import (
    Check,
    NotEquivalent,
    Report,
    Where,
    assert_equivalent,
)

__all__ = ["Check", "NotEquivalent", "Report", "Where", "assert_equivalent", "latents_like",
           "options"]


def __getattr__(name: str) -> Any:
    if name in ("options", "latents_like"):
        from tokpipe_compiler.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(name)
