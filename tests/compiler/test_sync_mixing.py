"""Sync mode runs the whole sequence as one chunk, so an op that mixes tokens in a way
chunking cannot (a sort, an unpadded 3x3 convolution on the latent), or only with caches
that sync does not need (Sana's linear attention and 3x3 convolutions, a mean over tokens),
runs whole there. Stale mode keeps Sana's in per-row caches; causal rejects them.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.fixtures.models import ConvAcrossRows, MeanOverTokens, SortOverTokens
from tests.fixtures.tracing import Traced, assert_rel_close, trace
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.core.errors import TokpipeError

SANA = "SanaTransformer2DModel"


@functools.cache
def traced_sana() -> tuple[torch.nn.Module, Traced]:
    pytest.importorskip("diffusers")
    model = build(SANA)
    return model, trace(model, **ZOO[SANA].inputs(0))


@pytest.mark.parametrize("stages", [1, 2])
def test_sana_linear_attention_in_sync_mode_equals_eager(stages):
    model, t = traced_sana()
    p = t.program(mode="sync", stages=stages, chunks=ZOO[SANA].chunks)
    assert len(p.plan.stages) == stages
    for seed in (1, 2):
        inputs = ZOO[SANA].inputs(seed)
        with torch.no_grad():
            expected = model(**inputs)[0]
        assert_rel_close(p(*t.with_arguments(inputs, strict=False))[0], expected)


def test_sana_in_stale_mode_equals_eager_on_a_repeated_input():
    """Warmup, then chunks that read the previous call's partial sums and halo rows: of the
    same input, so exact."""
    model, t = traced_sana()
    p = t.program(mode="stale", stages=2, chunks=ZOO[SANA].chunks, warmup_steps=1)
    inputs = ZOO[SANA].inputs(1)
    with torch.no_grad():
        expected = model(**inputs)[0]
        for _ in range(2):
            assert_rel_close(p(*t.with_arguments(inputs, strict=False))[0], expected)
    assert any(name.startswith("sum_cache") for name in p.caches.buffers)


def test_sana_in_causal_mode_is_rejected():
    _, t = traced_sana()
    with pytest.raises(TokpipeError, match="after the chunk"):
        t.program(mode="causal", stages=2, chunks=ZOO[SANA].chunks)


class SumOfAll(torch.nn.Module):
    """Every token shifted by a sum over all elements, a scalar."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.sum() * 1e-3 + h  # the sum first: an op on the scalar


@pytest.mark.parametrize(("model", "argument", "shape", "stages"), [
    (MeanOverTokens(), "x", (1, 8, 16), 1),
    (MeanOverTokens(), "x", (1, 8, 16), 2),
    (SortOverTokens(), "x", (1, 8, 16), 1),  # a tuple (values, indices) that mixes tokens
    (ConvAcrossRows(), "latents", (1, 4, 8, 8), 1),
    (SumOfAll(), "x", (1, 8, 16), 2),  # a scalar: no token axis left (specialize crashed)
])
def test_small_token_mixers_in_sync_mode_equal_eager(model, argument, shape, stages):
    model = model.eval()
    t = trace(model, torch.randn(shape))
    p = t.program(mode="sync", stages=stages, chunks=1)
    x = torch.randn(shape)
    with torch.no_grad():
        assert_rel_close(p(*t.args(**{argument: x}))[0], model(x))


def test_a_max_over_tokens_in_stale_mode_names_the_op():
    t = trace(MaxOverTokens().eval(), torch.randn(1, 8, 16))
    with pytest.raises(TokpipeError, match="amax over the token axis mixes tokens"):
        t.program(mode="stale", stages=1, chunks=2)


class MaxOverTokens(torch.nn.Module):
    """A max over tokens: not a sum, so no partial sums can stand in for it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)  # the hidden axis cannot be the token axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.amax(dim=1, keepdim=True)
