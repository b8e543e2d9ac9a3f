"""A map over pieces of the token axis, rejoined (diffusers' feed-forward chunking), is
computed whole before annotate (`passes/piecewise_maps.py`), so that a pipeline's chunks
cut it where they cut everything else; maps whose pieces cannot be joined so (attention
inside a piece, other weights per piece, a table per piece) are left as written.

Tolerance: assert_equivalent's float32 default, 1e-5 relative to the eager output.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures.models import Block
from tokpipe_compiler import released
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.testing import assert_equivalent

WIDTH, TOKENS = 16, 32


class PiecewiseMLP(nn.Module):
    """Attention blocks with an MLP over `pieces` pieces of the tokens after each. `kind`:
    "mlp" (feed-forward chunking), "attention" (windowed attention: each piece attends
    to itself), "weights" (each piece its own MLP), "table" (a per-piece position table),
    "first" (each row less its piece's first row)."""

    def __init__(self, kind: str = "mlp", pieces: int = 4):
        super().__init__()
        self.kind, self.pieces = kind, pieces
        self.blocks = nn.ModuleList(Block(WIDTH, 2) for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                nn.Linear(2 * WIDTH, WIDTH))
                                  for _ in range(pieces if kind == "weights" else 1))
        self.table = nn.Parameter(torch.randn(1, TOKENS // pieces, WIDTH))
        self.cond = nn.Parameter(torch.randn(1, WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.cond)
            x = x + torch.cat([self._map(i, p) for i, p in
                               enumerate(x.chunk(self.pieces, dim=1))], dim=1)
        return x

    def _map(self, index: int, piece: torch.Tensor) -> torch.Tensor:
        if self.kind == "attention":
            return F.scaled_dot_product_attention(piece[:, None], piece[:, None],
                                                  piece[:, None])[:, 0]
        if self.kind == "first":
            return piece - piece[:, :1]
        if self.kind == "table":
            return self.mlps[0](piece + self.table)
        return self.mlps[index if self.kind == "weights" else 0](piece)


def inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, TOKENS, WIDTH, generator=torch.Generator().manual_seed(0)),)


def equivalent(model: nn.Module, mode: str, chunks: int = 4) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        assert_equivalent(model, inputs(), stages=2, chunks=chunks, mode=mode)


@pytest.mark.parametrize("chunks", [2, 4, 8])  # pipeline chunks coarser, equal, finer
def test_feed_forward_chunking_pipelines_in_stale_mode(chunks):
    torch.manual_seed(0)
    equivalent(PiecewiseMLP("mlp").eval(), "stale", chunks)


@pytest.mark.parametrize("kind", ["attention", "weights", "table", "first"])
def test_maps_that_differ_from_the_whole_map_are_left_as_written(kind):
    """Sync runs what mixes tokens whole: it equals eager only if the map was kept."""
    torch.manual_seed(0)
    equivalent(PiecewiseMLP(kind).eval(), "sync")


def test_windowed_attention_is_refused_in_stale_mode():
    """Computed whole it would be global attention: the chunk op stays, and is refused."""
    torch.manual_seed(0)
    with pytest.raises(TokpipeError, match="chunk along the token axis"):
        equivalent(PiecewiseMLP("attention").eval(), "stale")


def test_sd3_with_forward_chunking_pipelines_in_stale_mode():
    """Released widths and text length, one block of each kind, a 16 x 16 latent (64 image
    tokens: MLP pieces of 16 against pipeline chunks of 32). HunyuanDiT offers the switch
    too, but its blocks never read it."""
    model = released.build("sd3-medium", 1, grid=(16, 16))
    model.enable_forward_chunking(16, dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(model, (), released.inputs("sd3-medium", 2, (16, 16)), stages=2,
                          chunks=2, mode="stale")
