"""Layouts the model zoo found untracked, on tiny hand-written models: grouped-query K/V heads
repeated to the query heads and a text mask with a row per query (Lumina-Next); an image in
a video layout of one frame, padded into a batch by pad_sequence (Z-Image); features added
in place to every frame but the first (WanAnimate's pose); a 1-D sequence patchified by a
convolution and unpatchified by its transpose (ACE-Step); a per-token table applied by an
einsum.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from tests.fixtures.tracing import Traced, assert_rel_close, trace
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.passes.slice_updates import functional_slice_adds


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """[B, L, heads, d] in, [B, L, heads * d] out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         **kwargs)
    return out.transpose(1, 2).flatten(2)


class GroupedQuery(nn.Module):
    """Self-attention whose K/V heads are repeated to the query heads as Lumina-Next does
    (even by 1), then cross-attention on text with its mask expanded over every query."""

    def __init__(self, kv_heads: int, width: int = 16, heads: int = 2, text: int = 12):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q, self.kv = nn.Linear(width, width), nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.cq, self.ckv = nn.Linear(width, width), nn.Linear(text, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        n_rep = self.heads // self.kv_heads
        k, v = (t.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3) for t in (k, v))
        x = x + attend(q, k, v)
        mask = text_mask.bool().view(b, 1, 1, -1).expand(-1, self.heads, n, -1)
        ck, cv = self.ckv(text).view(b, -1, 2, self.heads, self.head_dim).unbind(2)
        cq = self.cq(x).view(b, n, self.heads, self.head_dim)
        return self.out(x + attend(cq, ck, cv, attn_mask=mask))


class TokenRepeat(nn.Module):
    """Attention over the token sequence tiled twice: no chunk is one range of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = x.repeat(1, 2, 1).unsqueeze(2)
        return attend(x.unsqueeze(2), kv, kv)


class OneFrame(nn.Module):
    """Z-Image's layout: latents [B, C, F, H, W] with F = 1, each item patchified by a view
    whose frame factor is 1, the sequences padded into a batch, self-attention, unpatchify."""

    def __init__(self, channels: int = 4, width: int = 16, heads: int = 2, patch: int = 2):
        super().__init__()
        self.heads, self.patch = heads, patch
        self.embed = nn.Linear(patch * patch * channels, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.final = nn.Linear(width, patch * patch * channels)

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        c, f, h, w = image.shape
        p = self.patch
        image = image.view(c, f, 1, h // p, p, w // p, p)
        return image.permute(1, 3, 5, 2, 4, 6, 0).reshape(f * h // p * w // p, p * p * c)

    def unpatchify(self, tokens: torch.Tensor, c: int, f: int, h: int, w: int) -> torch.Tensor:
        p = self.patch
        tokens = tokens.view(f, h // p, w // p, 1, p, p, c)
        return tokens.permute(6, 0, 3, 1, 4, 2, 5).reshape(c, f, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = pad_sequence([self.embed(self.patchify(item)) for item in x], batch_first=True)
        b, n, width = tokens.shape
        q, k, v = self.qkv(tokens).view(b, n, 3, self.heads, width // self.heads).unbind(2)
        out = self.final(tokens + attend(q, k, v))
        return torch.stack([self.unpatchify(item, *x.shape[1:]) for item in out])


class AudioPatches(nn.Module):
    """ACE-Step's layout: latents [B, L, C] patchified by a Conv1d with kernel == stride,
    self-attention over the patches, unpatchified by a ConvTranspose1d of the same kernel."""

    def __init__(self, channels: int = 4, width: int = 16, heads: int = 2, patch: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv1d(channels, width, patch, patch)
        self.qkv = nn.Linear(width, 3 * width)
        self.final = nn.ConvTranspose1d(width, channels, patch, patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.transpose(1, 2)).transpose(1, 2)
        b, n, width = tokens.shape
        q, k, v = self.qkv(tokens).view(b, n, 3, self.heads, width // self.heads).unbind(2)
        out = tokens + attend(q, k, v)
        return self.final(out.transpose(1, 2)).transpose(1, 2)


class PoseOnLaterFrames(nn.Module):
    """WanAnimate's layout: patch-embedded video latents [B, D, F, H, W] get pose features
    added in place to frames 1.. (`x[:, :, 1:] = x[:, :, 1:] + pose`), then self-attention
    over every frame's patches. `peek`: also return the slice read before the update, a
    view that observes it."""

    def __init__(self, channels: int = 4, width: int = 16, heads: int = 2, peek: bool = False):
        super().__init__()
        self.heads, self.peek = heads, peek
        self.embed = nn.Conv3d(channels, width, (1, 2, 2), (1, 2, 2))
        self.pose = nn.Conv3d(channels, width, (1, 2, 2), (1, 2, 2))
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor, pose: torch.Tensor):
        h = self.embed(x)
        later = h[:, :, 1:]
        h[:, :, 1:] = h[:, :, 1:] + self.pose(pose)
        tokens = h.flatten(2).transpose(1, 2)
        b, n, width = tokens.shape
        q, k, v = self.qkv(tokens).view(b, n, 3, self.heads, width // self.heads).unbind(2)
        out = tokens + attend(q, k, v)
        return (out, later * 2) if self.peek else out


def assert_modes_equal_eager(model: nn.Module, traced: Traced, *inputs: torch.Tensor,
                             chunks: int) -> None:
    """sync, and stale on a repeated input (stale K/V are then the fresh ones), equal eager
    on the inputs the model was traced with."""
    with torch.no_grad():
        expected = model(*inputs)
    for mode in ("sync", "stale"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
            program = traced.program(mode=mode, stages=2, chunks=chunks, warmup_steps=1)
        program(*traced.args())
        assert_rel_close(program(*traced.args())[0], expected)


@pytest.mark.parametrize("kv_heads", [1, 2])  # K/V heads repeated by 2 and by 1
def test_grouped_query_heads_and_a_per_query_text_mask_equal_eager(kv_heads):
    torch.manual_seed(kv_heads)
    model = GroupedQuery(kv_heads).eval()
    x, text = torch.randn(1, 16, 16), torch.randn(1, 5, 12)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    assert_modes_equal_eager(model, trace(model, x, text, mask), x, text, mask, chunks=4)


def test_repeating_the_token_axis_is_refused_naming_the_op():
    traced = trace(TokenRepeat(), torch.randn(1, 16, 8))
    with pytest.raises(TokpipeError, match=r"- repeat\(.*\n    why: repeat x2 along the token "
                                           r"axis copies the whole sequence"):
        traced.program(mode="stale", stages=1, chunks=4)


def test_an_image_as_one_video_frame_is_cut_along_its_rows_and_equals_eager():
    torch.manual_seed(0)
    model = OneFrame().eval()
    x = torch.randn(1, 4, 1, 8, 16)
    traced = trace(model, x)
    assert traced.program(mode="stale", stages=1, chunks=4).plan.units == 4  # patch rows
    assert_modes_equal_eager(model, traced, x, chunks=4)


def test_a_transposed_convolution_unpatchifies_each_chunk_and_equals_eager():
    torch.manual_seed(0)
    model = AudioPatches().eval()
    x = torch.randn(1, 32, 4)
    traced = trace(model, x)
    assert traced.program(mode="stale", stages=1, chunks=4).plan.units == 16  # patches
    assert_modes_equal_eager(model, traced, x, chunks=4)


def test_features_added_in_place_to_later_frames_equal_eager():
    torch.manual_seed(0)
    model = PoseOnLaterFrames().eval()
    x, pose = torch.randn(1, 4, 4, 4, 4), torch.randn(1, 4, 3, 4, 4)
    traced = trace(model, x, pose)
    program = traced.program(mode="stale", stages=1, chunks=4)
    assert program.plan.units == 4  # one frame per unit: the update at frames 1.. is cut too
    assert_modes_equal_eager(model, traced, x, pose, chunks=4)


def test_an_update_a_view_observes_stays_in_place_and_is_refused():
    """Rewritten out of place, `later` (read before the update, returned after it) would
    miss the pose: the compiler keeps the setitem and refuses the slice instead."""
    model = PoseOnLaterFrames(peek=True).eval()
    traced = trace(model, torch.randn(1, 4, 4, 4, 4), torch.randn(1, 4, 3, 4, 4))
    with pytest.raises(TokpipeError, match="cuts through the chunks"):
        traced.program(mode="stale", stages=1, chunks=4)


class SwappedSliceAdd(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h[1:3, :, 2:] = y + h[1:3, :, 2:]  # the addend first, two sliced axes
        return h.sin()


def test_a_slice_add_is_rewritten_out_of_place_with_the_same_values():
    x, y = torch.randn(4, 3, 5), torch.randn(2, 3, 3)
    traced = trace(SwappedSliceAdd(), x, y)
    functional_slice_adds(traced.gm)
    targets = [n.target for n in traced.gm.graph.nodes]
    assert operator.setitem not in targets and F.pad in targets
    assert torch.equal(traced.gm(*traced.args())[0], SwappedSliceAdd()(x, y))


class EinsumTable(nn.Module):
    """Tokens scaled by a per-token table through an einsum ("bnd,nd->bnd"), then attention.
    The chunks ran it on the whole table and failed at the first chunked call."""

    def __init__(self, tokens: int = 16, width: int = 8):
        super().__init__()
        self.table = nn.Parameter(torch.randn(tokens, width))
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bnd,nd->bnd", x, self.table)
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, -1)).unbind(2)
        return h + attend(q, k, v)


def test_an_einsum_with_a_per_token_table_takes_each_chunks_rows():
    torch.manual_seed(0)
    model = EinsumTable().eval()
    x = torch.randn(1, 16, 8)
    assert_modes_equal_eager(model, trace(model, x), x, chunks=4)


class AxisMoves(nn.Module):
    """The token axis moved by movedim, a feature range taken by narrow and some features
    picked by index_select: none reaches across tokens (all three had no rule)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.register_buffer("picked", torch.tensor([3, 1, 0, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).unbind(2)
        h = attend(q, k, v).movedim(1, -1)  # [B, D, L]
        h = h.movedim(-1, 1)
        head = h.narrow(-1, 0, 4).index_select(-1, self.picked)
        return torch.cat([head, h.narrow(-1, 4, 4)], -1) + x


def test_movedim_narrow_and_index_select_off_the_token_axis_equal_eager():
    torch.manual_seed(0)
    model = AxisMoves().eval()
    x = torch.randn(1, 16, 8)
    assert_modes_equal_eager(model, trace(model, x), x, chunks=4)


class NarrowTokens(nn.Module):
    """Attention over the tokens (so they are axis 1), then their first half, twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = attend(*(x.unflatten(-1, (1, -1)),) * 3)
        return h.narrow(1, 0, 8).repeat(1, 2, 1)


def test_narrow_along_the_token_axis_is_refused_naming_it():
    traced = trace(NarrowTokens(), torch.randn(1, 16, 8))
    with pytest.raises(TokpipeError, match="narrow along the token axis takes rows of the "
                                           "whole sequence"):
        traced.program(mode="stale", stages=1, chunks=4)


class SwapBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attend(*(x.unflatten(-1, (1, -1)),) * 3)[[1, 0]]


def test_indices_before_the_token_axis_are_refused_in_plain_words():
    """The reason named an internal type ("advanced indexing with immutable_list")."""
    traced = trace(SwapBatch(), torch.randn(2, 16, 8))
    with pytest.raises(TokpipeError, match=r"indexing axis 0, before the token axis, with a "
                                           r"list or tensor of indices"):
        traced.program(mode="stale", stages=1, chunks=4)
