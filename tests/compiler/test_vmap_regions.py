"""Traced torch.vmap regions (flex_attention builds its block masks with one): nesting
levels are global state, so a region runs whole in the prelude, or is refused when it
computes from the tokens. Sync mode, 2 stages, eager stage graphs.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from tests.fixtures.tracing import Traced, assert_rel_close, trace
from tokpipe_compiler.core.errors import TokpipeError


class FlexAttention(nn.Module):
    """Self-attention through flex_attention with a relative-position score_mod (a
    subgraph the stage reads as a module attribute; the default block mask is vmapped)."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.1 * (i - j))
        return self.out(x + out.transpose(1, 2).flatten(2))


class VmapOverTokens(nn.Module):
    """A per-token function through torch.vmap: the vmapped region reads the tokens."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda row: row.softmax(-1) * 2)(self.proj(x))


def sync_program(traced: Traced):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        return traced.program(mode="sync", stages=2, chunks=1)


def test_flex_attention_runs_its_vmapped_mask_in_the_prelude_and_equals_eager():
    torch.manual_seed(0)
    model, x = FlexAttention().eval(), torch.randn(1, 16, 16)
    traced = trace(model, x)
    with torch.no_grad():
        expected = model(x)
    assert_rel_close(sync_program(traced)(*traced.args())[0], expected)


def test_a_vmap_over_the_tokens_is_refused_naming_it():
    traced = trace(VmapOverTokens().eval(), torch.randn(1, 16, 16))
    with pytest.raises(TokpipeError, match=r"inside a traced torch\.vmap"):
        sync_program(traced)
