"""diffusers' attention backends a transformer is set to (`set_attention_backend`): flex
attention has no token rule, so sync mode computes it, and what follows, whole. A ring
carries the latents chunk by chunk, so a parallelized pipeline runs such a generation per
call, and says which op: its ring refused the step with an error about text tokens or a
mean over the latent, neither of which the model had.

Tolerance: sync equals the serial pipeline with the same backend within 1e-5 of the
output's largest value (float32 compute).
"""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import generate, wan
from tests.fixtures.tracing import rel_error

pytest.importorskip("diffusers")


@pytest.fixture
def active_backend_kept():
    """set_attention_backend also sets diffusers' process-wide active backend, which
    reset_attention_backend leaves: every later model in the process would use it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_runs_per_call_and_names_the_op(active_backend_kept):
    serial, kwargs = wan()
    serial.transformer.set_attention_backend("flex")
    expected = generate(serial, kwargs, steps=3)
    pipe, _ = wan()
    pipe.transformer.set_attention_backend("flex")
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    with pytest.warns(UserWarning, match=r"runs per call.*every chunk computes whole: no "
                                         r"token rule chunks flex_attention\(.*no token "
                                         r"rule for 'flex_attention'"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, expected) <= 1e-5
    assert torch.isfinite(out).all()
