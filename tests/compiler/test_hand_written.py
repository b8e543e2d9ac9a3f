"""Hand-written DiTs in the styles model authors use, each once broke planning: a
positional table cast to the input with `table.to(x)` (the form `.to(other)`).

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager| (assert_equivalent).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokpipe_compiler.testing import assert_equivalent


def unpatchify(h: torch.Tensor, grid: tuple[int, int], channels: int) -> torch.Tensor:
    """[B, gh * gw, 2 * 2 * C] patches -> [B, C, 2 gh, 2 gw]."""
    (gh, gw), b = grid, h.shape[0]
    return h.view(b, gh, gw, 2, 2, channels).permute(0, 5, 1, 3, 2, 4).reshape(
        b, channels, 2 * gh, 2 * gw)


class CastTable(nn.Module):
    """A float64 positional table brought to the tokens' dtype and device by `cast`."""

    def __init__(self, cast: str, width: int = 32, heads: int = 2, tokens: int = 96):
        super().__init__()
        self.cast, self.heads = cast, heads
        self.embed = nn.Conv2d(4, width, 2, 2)
        self.register_buffer("table", torch.randn(1, tokens, width, dtype=torch.float64))
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(2).transpose(1, 2)
        table = {"to(x)": lambda: self.table.to(x),
                 "to(x, copy)": lambda: self.table.to(x, False, True),
                 "to(tensor=x)": lambda: self.table.to(tensor=x),
                 "type_as(x)": lambda: self.table.type_as(x)}[self.cast]()
        h = h + table
        b, n, width = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, width)
        return unpatchify(self.out(h), (x.shape[2] // 2, x.shape[3] // 2), 4)


@pytest.mark.parametrize("cast", ["to(x)", "to(x, copy)", "to(tensor=x)", "type_as(x)"])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_a_table_cast_like_the_input_stays_invariant(cast: str, mode: str):
    """`.to(x)` used to carry x's tokens into the table: 'operands carry tokens on
    different axes' (stale) or a chunk's broadcast failing (sync)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(CastTable(cast).eval(), (torch.randn(1, 4, 16, 24),), stages=2,
                          chunks=4, mode=mode)
