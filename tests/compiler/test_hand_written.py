"""Hand-written DiTs in the styles model authors use, each once broke planning: a
positional table cast to the input with `table.to(x)` (the form `.to(other)`); attention
in x-transformers' einsum layout or with `k.mT`; a class token read by position; patches
by pixel_unshuffle and pixel_shuffle; blocks left under activation checkpointing.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager| (assert_equivalent).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokpipe_compiler import TokpipeError
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spelling: str,
           causal: bool) -> torch.Tensor:
    """Attention over [B, N, H, D] queries, keys and values, spelt as research code does."""
    n, scale = q.shape[1], q.shape[-1] ** -0.5
    if spelling == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
    if spelling == "einsum bnhd":  # x-transformers' layout: heads after the tokens
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    else:  # "k.mT"
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.mT) * scale
    if causal:  # the later keys hidden
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if spelling == "einsum bnhd":
        return torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v)
    return (scores.softmax(-1) @ v).transpose(1, 2)


class TokenDiT(nn.Module):
    """Patches by a convolution (or pixel_unshuffle and a linear layer), a class token
    prepended or a register token appended and read back by position, two blocks of
    attention, patches back to pixels by a reshape (or pixel_shuffle)."""

    def __init__(self, spelling: str = "sdpa", causal: bool = False, readout: str = "",
                 shuffle: bool = False, width: int = 32, heads: int = 2):
        super().__init__()
        self.spelling, self.causal, self.readout, self.shuffle = spelling, causal, readout, shuffle
        self.heads = heads
        self.embed = nn.Linear(16, width) if shuffle else nn.Conv2d(4, width, 2, 2)
        self.token = nn.Parameter(torch.randn(1, 1, width))
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(2))
        self.out, self.head = nn.Linear(width, 16), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, grid = x.shape[0], (x.shape[2] // 2, x.shape[3] // 2)
        if self.shuffle:
            h = self.embed(F.pixel_unshuffle(x, 2).flatten(2).transpose(1, 2))
        else:
            h = self.embed(x).flatten(2).transpose(1, 2)
        token = self.token.expand(b, -1, -1)
        extra = {"class": [token, h], "register": [h, token]}.get(self.readout, [h])
        h = torch.cat(extra, 1)
        for qkv in self.qkv:
            q, k, v = qkv(h).view(b, h.shape[1], 3, self.heads, -1).unbind(2)
            h = h + attend(q, k, v, self.spelling, self.causal).reshape(h.shape)
        read = {"class": 0, "register": -1, "patch": 5}.get(self.readout)
        logits = self.head(h[:, read]) if read is not None else None
        h = self.out(h[:, 1:] if self.readout == "class" else h[:, :grid[0] * grid[1]])
        if self.shuffle:
            image = F.pixel_shuffle(h.transpose(1, 2).reshape(b, 16, *grid), 2)
        else:
            image = unpatchify(h, grid, 4)
        return image if logits is None else (image, logits)


def check(model: nn.Module, mode: str) -> None:
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(model.eval(), (torch.randn(2, 4, 16, 24),), stages=2, chunks=4,
                          mode=mode)


@pytest.mark.parametrize("spelling", ["einsum bnhd", "k.mT"])
@pytest.mark.parametrize("mode", ["sync", "stale", "causal"])
def test_attention_spelt_in_other_layouts_is_folded(spelling: str, mode: str):
    """einsum("bnhd,bmhd->bhnm") attention used to be left as einsums ('einsum operands
    carry tokens on different letters'), and `q @ k.mT` left a getattr(k, "mT") without a
    token rule: stale and causal refused both."""
    torch.manual_seed(0)
    check(TokenDiT(spelling, causal=mode == "causal"), mode)


@pytest.mark.parametrize(("readout", "mode"), [("class", "sync"), ("class", "stale"),
                                               ("class", "causal"), ("register", "sync"),
                                               ("register", "stale")])
def test_a_token_outside_the_chunked_ones_is_read_by_position(readout: str, mode: str):
    """`h[:, 0]` of a class token prepended by cat (or `h[:, -1]` of one appended) used to
    be refused: 'indexing the token axis with 0'; `h[:, :1]` was not."""
    torch.manual_seed(0)
    check(TokenDiT(causal=mode == "causal", readout=readout), mode)


def test_a_position_among_the_chunked_tokens_is_refused():
    torch.manual_seed(0)
    with pytest.raises(TokpipeError, match=r"indexing the token axis with 5: token 5 is one "
                                           r"of the chunked tokens \[0, 96\)"):
        check(TokenDiT(readout="patch"), "stale")


@pytest.mark.parametrize("mode", ["sync", "stale", "causal"])
def test_pixel_shuffle_unpatchifies_and_pixel_unshuffle_patchifies(mode: str):
    """F.pixel_shuffle and F.pixel_unshuffle had no token rule."""
    torch.manual_seed(0)
    check(TokenDiT(causal=mode == "causal", shuffle=True), mode)


def test_einsum_attention_left_unfolded_names_the_folded_forms():
    """Einsum scores that no softmax reads are not attention: the refusal of the einsum
    says which einsums are folded."""

    class ScoresRead(TokenDiT):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x).flatten(2).transpose(1, 2)
            q, k, _ = self.qkv[0](h).view(*h.shape[:2], 3, self.heads, -1).unbind(2)
            scores = torch.einsum("bnhd,bmhd->bhnm", q, k)
            return unpatchify(self.out(h) * scores.amax(), (x.shape[2] // 2, x.shape[3] // 2), 4)

    torch.manual_seed(0)
    with pytest.raises(TokpipeError, match=r"einsum\('bhid,bhjd->bhij', q, k\)"):
        check(ScoresRead(), "stale")



class CheckpointedBlock(nn.Module):
    """Self-attention and an MLP, the MLP under `checkpoint` (nested in the block's);
    returns a pair, as blocks that pass their conditioning on do."""

    def __init__(self, width: int, causal: bool, checkpointed: bool):
        super().__init__()
        self.causal, self.checkpointed = causal, checkpointed
        self.norm, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), \
            nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, cond: torch.Tensor):
        q, k, v = self.qkv(self.norm(x) + cond[:, None]).unflatten(-1, (3, 2, -1)).permute(
            2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
                          .transpose(1, 2).flatten(2))
        mlp = checkpoint(self.mlp, x, use_reentrant=False) if self.checkpointed \
            else self.mlp(x)
        return x + mlp, cond


class Checkpointed(nn.Module):
    """Blocks run under `torch.utils.checkpoint`, left in from training as research code
    often leaves it (`checkpointed=False`: the same model without it)."""

    def __init__(self, causal: bool = False, checkpointed: bool = True, width: int = 32):
        super().__init__()
        self.checkpointed = checkpointed
        self.embed, self.time = nn.Conv2d(4, width, 2, 2), nn.Linear(1, width)
        self.blocks = nn.ModuleList(CheckpointedBlock(width, causal, checkpointed)
                                    for _ in range(2))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h, cond = self.embed(x).flatten(2).transpose(1, 2), self.time(timestep[:, None])
        for block in self.blocks:
            h, cond = checkpoint(block, h, cond, use_reentrant=False) if self.checkpointed \
                else block(h, cond)
        return unpatchify(self.out(h), (x.shape[2] // 2, x.shape[3] // 2), 4)


@pytest.mark.parametrize(("mode", "causal"), [("sync", False), ("stale", False),
                                              ("causal", True)])
def test_blocks_left_under_activation_checkpointing_are_pipelined(mode: str, causal: bool):
    """Dynamo traces a checkpointed call as a call of a subgraph, which once had no token
    rule ("no token rule for 'tag_activation_checkpoint'"); in inference it is its body."""
    torch.manual_seed(0)
    args = (torch.randn(1, 4, 16, 16), torch.tensor([500.0]))
    assert_equivalent(Checkpointed(causal).eval(), args, stages=2, chunks=4, mode=mode)


def test_checkpointed_blocks_give_the_plain_models_stale_steps():
    """After warmup, stale steps differ from eager: with and without checkpointing they
    are the same steps, bit for bit."""
    options = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager"}
    x = torch.randn(1, 4, 16, 16)
    results = []
    for checkpointed in (True, False):
        torch.manual_seed(0)
        model = torch.compile(Checkpointed(checkpointed=checkpointed).eval(),
                              backend="tokpipe", dynamic=False, options=options)
        with torch.no_grad():
            results.append([model(x, timestep=torch.tensor([t])) for t in (900.0, 800.0)])
    with torch.no_grad():
        torch.manual_seed(0)
        eager = Checkpointed(checkpointed=False).eval()(x, torch.tensor([800.0]))
    assert not torch.equal(results[1][1], eager)  # the second step is stale
    for with_checkpoints, without in zip(*results, strict=True):
        assert torch.equal(with_checkpoints, without)



LIBRARY = torch.library.Library("tokpipetest", "FRAGMENT")  # a user's custom ops


class CompressedKeys(nn.Module):
    """PixArt-Sigma's key/value compression: keys and values from a stride-2 convolution
    of the token grid, a quarter of the queries' tokens."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed, self.out = nn.Conv2d(4, width, 2, 2), nn.Linear(width, 16)
        self.q, self.kv = nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.pool = nn.Conv2d(width, width, 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.embed(x)
        h = grid.flatten(2).transpose(1, 2)
        k, v = self.kv(self.pool(grid).flatten(2).transpose(1, 2)).chunk(2, dim=-1)
        h = h + F.scaled_dot_product_attention(self.q(h)[:, None], k[:, None], v[:, None])[:, 0]
        return unpatchify(self.out(h), (x.shape[2] // 2, x.shape[3] // 2), 4)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_attention_over_compressed_keys_runs_in_sync_and_says_how_otherwise():
    """The refusal's advice fits the attention it refuses: it is sdpa already."""
    torch.manual_seed(0)
    model, x = CompressedKeys().eval(), torch.randn(1, 4, 16, 16)
    assert_equivalent(model, (x,), stages=2, mode="sync")
    with pytest.raises(TokpipeError) as refused:
        assert_equivalent(model, (x,), stages=2, chunks=2, mode="stale")
    advice = str(refused.value).split("What you can do:")[1]
    assert "keys and values from the queries' own tokens" in advice
    assert "mode='sync'" in advice and "through F.scaled_dot_product_attention" not in advice


class Hourglass(nn.Module):
    """Tokens merged 2x2 by a pooling, attention at the low resolution, split back by a
    nearest upsampling (`down`, `up`: the ops spelt as the model spells them)."""

    def __init__(self, down: str = "avg", up: str = "interpolate", width: int = 32):
        super().__init__()
        self.down, self.up = down, up
        self.embed, self.out = nn.Conv2d(4, width, 2, 2), nn.Linear(width, 16)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.upsample = nn.Upsample(scale_factor=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.embed(x)
        low = F.avg_pool2d(grid, 2) if self.down == "avg" else F.max_pool2d(grid, (2, 2))
        h, w = low.shape[2:]
        q, k, v = self.qkv(low.flatten(2).transpose(1, 2)).unflatten(-1, (3, 2, -1)).permute(
            2, 0, 3, 1, 4)
        a = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        a = a.transpose(1, 2).unflatten(2, (h, w))
        up = self.upsample(a) if self.up == "module" else \
            F.interpolate(a, scale_factor=2, mode=self.up.split(":")[-1] or "nearest")
        tokens = (grid + up).flatten(2).transpose(1, 2)
        return unpatchify(self.out(tokens), (x.shape[2] // 2, x.shape[3] // 2), 4)


@pytest.mark.filterwarnings("ignore:tokpipe. mode=.stale. found no timestep")
@pytest.mark.parametrize(("down", "up"), [("avg", "interpolate:"), ("max", "module"),
                                          ("avg", "interpolate:nearest-exact")])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_an_hourglass_of_pooling_and_nearest_upsampling_is_pipelined(down, up, mode):
    """avg_pool2d and max_pool2d with kernel == stride merge bands of rows as a patchify
    convolution does; a nearest upsampling splits them as pixel_shuffle does."""
    torch.manual_seed(0)
    assert_equivalent(Hourglass(down, up).eval(), (torch.randn(1, 4, 32, 16),), stages=2,
                      chunks=4, mode=mode)


@pytest.mark.parametrize(("spelling", "why"), [
    ("bilinear", "interpolate(mode='bilinear') blends neighbouring rows"),
    ("size", "interpolate(size=...) along the token axis"),
    ("overlapping", "avg_pool2d with kernel 3, stride 2, padding 1"),
    ("uneven", "avg_pool2d by 1/3 along the token axis does not tile its 8 rows"),
])
def test_resampling_across_chunk_rows_is_refused_with_its_reason(spelling, why):
    class Resampled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Conv2d(4, 16, 2, 2), nn.Linear(16, 16)

        def forward(self, x):
            grid = self.embed(x)
            if spelling == "bilinear":
                grid = F.interpolate(F.avg_pool2d(grid, 2), scale_factor=2, mode="bilinear")
            elif spelling == "size":
                grid = F.interpolate(F.avg_pool2d(grid, 2), size=grid.shape[2:])
            elif spelling == "uneven":
                grid = F.interpolate(F.avg_pool2d(grid, 3, ceil_mode=True), scale_factor=3)
                grid = grid[:, :, :8, :8]
            else:
                grid = F.interpolate(F.avg_pool2d(grid, 3, 2, 1), scale_factor=2)
            tokens = grid.flatten(2).transpose(1, 2)
            return unpatchify(self.out(tokens), (x.shape[2] // 2, x.shape[3] // 2), 4)

    with pytest.raises(TokpipeError, match=re.escape(why)):
        assert_equivalent(Resampled().eval(), (torch.randn(1, 4, 16, 16),), stages=2,
                          chunks=2, mode="stale")


@pytest.mark.parametrize("overload", [False, True])
def test_a_custom_op_without_a_token_rule_is_named_by_its_qualified_name(overload):
    """A torch.library op the compiler has no rule for is refused by its own name, not
    its overload's ('default')."""
    if not hasattr(torch.ops.tokpipetest, "shift"):
        LIBRARY.define("shift(Tensor x) -> Tensor")
        LIBRARY.impl("shift", lambda x: torch.roll(x, 1, dims=1), "CompositeExplicitAutograd")
        LIBRARY.impl("shift", lambda x: torch.empty_like(x), "Meta")
    shift = torch.ops.tokpipetest.shift.default if overload else torch.ops.tokpipetest.shift

    class Shifts(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Conv2d(4, 16, 2, 2), nn.Linear(16, 16)

        def forward(self, x):
            tokens = shift(self.embed(x).flatten(2).transpose(1, 2))
            return unpatchify(self.out(tokens), (x.shape[2] // 2, x.shape[3] // 2), 4)

    with pytest.raises(TokpipeError, match=r"tokpipetest::shift\(\(1, 16, 16\)\)"):
        assert_equivalent(Shifts().eval(), (torch.randn(1, 4, 8, 8),), stages=2, chunks=2,
                          mode="stale")
