"""Patch embedding by unfold: `F.unfold(x, p, stride=p)` and `x.unfold(2, p, p).unfold(3, p, p)`
take each band of p latent rows to its own run of tokens, as a patchify convolution does, so
chunks of whole bands pipeline. Overlapping windows reach into the neighbouring chunks: refused.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager| (assert_equivalent).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures.tracing import trace
from tokpipe_compiler import TokpipeError
from tokpipe_compiler.testing import assert_equivalent

PATCH = 2


def patches(x: torch.Tensor, style: str, size: int = PATCH, step: int = PATCH) -> torch.Tensor:
    """[B, C, H, W] -> [B, tokens, C * size * size], windows of `size` every `step`."""
    b, c = x.shape[:2]
    if style == "F.unfold":
        return F.unfold(x, size, stride=step).transpose(1, 2)
    windows = x.unfold(2, size, step).unfold(3, size, step)  # [B, C, gh, gw, size, size]
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * size * size)


class UnfoldDiT(nn.Module):
    """Patchify by `style`, two self-attention blocks, unpatchify by view/permute (or the
    patches out: then nothing but the unfold shows that a chunk holds whole patch rows)."""

    def __init__(self, style: str, causal: bool = False, unpatchify: bool = True,
                 channels: int = 4, width: int = 16, heads: int = 2):
        super().__init__()
        self.style, self.causal, self.unpatchify, self.heads = style, causal, unpatchify, heads
        self.embed = nn.Linear(channels * PATCH * PATCH, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(2))
        self.out = nn.Linear(width, channels * PATCH * PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.embed(patches(x, self.style))
        n, d = h.shape[1:]
        for qkv in self.qkv:
            q, k, v = qkv(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            h = h + a.transpose(1, 2).reshape(b, n, d)
        if not self.unpatchify:
            return self.out(h)
        gh, gw = height // PATCH, width // PATCH
        return self.out(h).view(b, gh, gw, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5).reshape(
            b, c, height, width)


STYLES = ["F.unfold", "Tensor.unfold"]
# 12 latent rows are 6 patch rows; 4 chunks of them are uneven (2, 2, 1, 1 patch rows),
# so a chunk cut inside a band of 2 latent rows would show.
LATENTS = (1, 4, 12, 16)
MODES = [("sync", 1), ("stale", 1), ("stale", 0), ("causal", 1)]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(("mode", "warmup"), MODES)
def test_an_unfold_patchify_equals_eager(style: str, mode: str, warmup: int):
    """Stale: exact after a warmup, and on the repeated input without one."""
    torch.manual_seed(0)
    model = UnfoldDiT(style, causal=mode == "causal").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        assert_equivalent(model, (torch.randn(*LATENTS),), stages=2, chunks=4, mode=mode,
                          warmup_steps=warmup)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_an_unfold_patchify_with_patches_out_chunks_whole_patch_rows(style: str, mode: str):
    """A unit of the token grid is one band of PATCH latent rows, never part of one, also
    where no unpatchify splits the tokens into patch rows again."""
    torch.manual_seed(0)
    model = UnfoldDiT(style, unpatchify=False).eval()
    traced = trace(model, torch.randn(*LATENTS))
    assert traced.program(mode="stale", stages=1, chunks=4).plan.units == 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(model, (torch.randn(*LATENTS),), stages=2, chunks=4, mode=mode)


@pytest.mark.parametrize(("style", "refused"), [
    ("F.unfold", r"F.unfold with kernel 4, stride 2, padding 0, dilation 1 along the token "
                 r"rows takes rows of neighbouring chunks \(chunked: kernel == stride"),
    ("Tensor.unfold", r"Tensor.unfold with size 4, step 2 along the token axis takes rows of "
                      r"neighbouring chunks \(chunked: kernel == stride"),
])
def test_overlapping_unfold_windows_are_refused_with_the_way_out(style: str, refused: str):
    class Overlapping(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = patches(x, style, size=4, step=2)
            return F.scaled_dot_product_attention(h, h, h)

    traced = trace(Overlapping(), torch.randn(*LATENTS))
    with pytest.raises(TokpipeError, match=refused) as raised:
        traced.program(mode="stale", stages=1, chunks=4)
    message = str(raised.value)
    assert "view/reshape" in message and "'fallback': True" in message
    assert "through F.scaled_dot_product_attention" not in message  # advice for attention
