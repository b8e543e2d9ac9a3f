"""Sums over the token axis (a mean over tokens, group_norm statistics, linear attention's
K^T V) pipelined with per-unit partial sums, and 3x3 convolutions across rows with a halo
of cached rows: exact in sync mode and on warmup calls; in stale mode chunk p sees this
call's values up to its own rows and the previous call's after them.

Tolerance: float32, max |pipelined - reference| <= 1e-5 * max |reference|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tokpipe_compiler as tp
from tests.fixtures.models import MeanOverTokens
from tests.fixtures.tracing import assert_rel_close, trace
from tokpipe_compiler.core.errors import TokpipeError

ROWS, CHUNKS = 8, 2
BOUNDS = [(0, 4), (4, 8)]  # the chunks' rows: 8 rows in 2 chunks


class GroupNormBlock(nn.Module):
    """conv 1x1 -> GroupNorm over channels x all rows -> conv 1x1 (rows are the tokens)."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Conv2d(4, 8, 1), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.norm(self.inp(latents))))


class LinearAttention(nn.Module):
    """Sana's linear attention in one head: relu(q) (relu(v)^T relu(k)) summed over tokens."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.relu(self.q(x)), F.relu(self.k(x)), self.v(x)
        kv = torch.matmul(v.transpose(1, 2), k)  # [B, D, D]: contracts over the tokens
        return torch.matmul(q, kv.transpose(1, 2)) / (1 + k.sum(dim=1, keepdim=True).abs())


class RowConv(nn.Module):
    """Sana's feed-forward: conv 1x1 -> depthwise 3x3 across rows and columns -> conv 1x1."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)
        self.depth = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.depth(self.inp(latents))))


def stale_mean(m: MeanOverTokens, before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    h0, h1 = m.lin(before), m.lin(now)
    return torch.cat([h1[:, a:b] - torch.cat([h1[:, :b], h0[:, b:]], 1).mean(1, keepdim=True)
                      for a, b in BOUNDS], 1)


def stale_group_norm(m: GroupNormBlock, before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    x0, x1 = m.inp(before), m.inp(now)
    pieces = []
    for a, b in BOUNDS:
        seen = torch.cat([x1[:, :, :b], x0[:, :, b:]], 2).reshape(1, 2, -1)
        mean, var = seen.mean(-1), seen.var(-1, unbiased=False)
        x = x1[:, :, a:b].reshape(1, 2, -1)
        normed = ((x - mean[..., None]) / torch.sqrt(var[..., None] + m.norm.eps))
        normed = normed.reshape(1, 8, b - a, ROWS) * m.norm.weight[:, None, None] \
            + m.norm.bias[:, None, None]
        pieces.append(m.out(F.silu(normed)))
    return torch.cat(pieces, 2)


def stale_linear_attention(m: LinearAttention, before: torch.Tensor,
                           now: torch.Tensor) -> torch.Tensor:
    k0, v0 = F.relu(m.k(before)), m.v(before)
    q1, k1, v1 = F.relu(m.q(now)), F.relu(m.k(now)), m.v(now)
    pieces = []
    for a, b in BOUNDS:
        k, v = torch.cat([k1[:, :b], k0[:, b:]], 1), torch.cat([v1[:, :b], v0[:, b:]], 1)
        kv = torch.matmul(v.transpose(1, 2), k)
        pieces.append(torch.matmul(q1[:, a:b], kv.transpose(1, 2))
                      / (1 + k.sum(dim=1, keepdim=True).abs()))
    return torch.cat(pieces, 1)


def stale_row_conv(m: RowConv, before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    x0, x1 = m.inp(before), m.inp(now)
    pieces = []
    for a, b in BOUNDS:
        seen = torch.cat([x1[:, :, :b], x0[:, :, b:]], 2)  # this call's rows up to the chunk's
        pieces.append(m.out(F.silu(m.depth(seen)[:, :, a:b])))
    return torch.cat(pieces, 2)


CASES = {  # model, its input's name and shape, the stale reference
    "mean": (MeanOverTokens, "x", (1, ROWS, 16), stale_mean),
    "group_norm": (GroupNormBlock, "latents", (1, 4, ROWS, ROWS), stale_group_norm),
    "linear_attention": (LinearAttention, "x", (1, ROWS, 16), stale_linear_attention),
    "row_conv": (RowConv, "latents", (1, 4, ROWS, ROWS), stale_row_conv),
}


def setup(case: str, **options):
    torch.manual_seed(0)
    model_class, name, shape, reference = CASES[case]
    model = model_class().eval()
    t = trace(model, torch.randn(shape))
    program = t.program(chunks=CHUNKS, **options)
    return model, (lambda x: program(*t.args(**{name: x}))[0]), program, shape, reference


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stages", [1, 2])
def test_sync_equals_eager(case, stages):
    model, run, p, shape, _ = setup(case, mode="sync", stages=stages)
    for _ in range(2):
        x = torch.randn(shape)
        with torch.no_grad():
            assert_rel_close(run(x), model(x))
    assert p.plan.caches == []  # sync runs the sums whole: no partial sums kept


@pytest.mark.parametrize("case", CASES)
def test_stale_sees_the_previous_calls_partial_sums_after_the_chunk(case):
    model, run, _, shape, reference = setup(case, mode="stale", stages=2, warmup_steps=1)
    xs = [torch.randn(shape) for _ in range(3)]
    with torch.no_grad():
        outs = [run(x) for x in xs]
        assert_rel_close(outs[0], model(xs[0]))  # the warmup call is exact
        for k in (1, 2):
            expected = reference(model, xs[k - 1], xs[k])
            assert_rel_close(outs[k], expected)
            assert (outs[k] - model(xs[k])).abs().max() > 1e-3  # the stale rows count


class ChannelsLastConv(RowConv):
    """RowConv whose depthwise convolution reads channels-last strides, as Sana's Mix-FFN
    does (its tokens [B, rows * cols, C] permuted to an image)."""

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        image = self.inp(latents).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return self.out(F.silu(self.depth(image)))


@pytest.mark.parametrize("make", [
    ChannelsLastConv,  # the convolution's input is channels-last; its cached window is not
    pytest.param(GroupNormBlock, marks=pytest.mark.full),
    pytest.param(LinearAttention, marks=pytest.mark.full),
])
def test_inductor_stages_compute_what_eager_stages_do(make):
    """Inductor compiles the code around each op for the output strides of its fake
    implementation and checks them at run time: the ops' kernels must give those strides
    whichever path (whole sequence, or a chunk with cached rows) they take."""
    torch.manual_seed(0)
    model = make().eval()
    name, shape = {ChannelsLastConv: ("latents", (1, 4, ROWS, ROWS)),
                   GroupNormBlock: ("latents", (1, 4, ROWS, ROWS)),
                   LinearAttention: ("x", (1, ROWS, 16))}[make]
    t = trace(model, torch.randn(shape))
    options = {"mode": "stale", "stages": 2, "chunks": CHUNKS, "warmup_steps": 1}
    compiled, eager = (t.program(compiler=c, **options) for c in ("inductor", "eager"))
    with torch.no_grad():
        for x in (torch.randn(shape), torch.randn(shape)):  # warmup, then stale chunks
            args = t.args(**{name: x})
            assert_rel_close(compiled(*args)[0], eager(*args)[0])


@pytest.mark.parametrize("case", CASES)
def test_causal_mode_refuses_sums_over_tokens(case):
    what = "convolves rows after the chunk" if case == "row_conv" else "sums over every token"
    with pytest.raises(TokpipeError, match=what):
        setup(case, mode="causal", stages=1)


def test_reset_drops_the_partial_sums():
    model, run, p, shape, _ = setup("group_norm", mode="stale", stages=2, warmup_steps=1)
    x0, x1 = torch.randn(shape), torch.randn(shape)
    with torch.no_grad():
        run(x0)
        assert any(name.startswith("sum_cache") for name in p.caches.buffers)
        p.reset()
        assert not p.branches
        assert_rel_close(run(x1), model(x1))  # a warmup call again


def test_ring_equals_per_call_loop():
    torch.manual_seed(0)
    model = GroupNormBlock().eval()
    options = {"stages": 2, "chunks": CHUNKS, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager"}

    def step(latents, c):
        return (latents - c * model(latents),)

    latents, cs = torch.randn(1, 4, ROWS, ROWS), torch.linspace(0.3, 0.1, 4)
    (ring,) = tp.Ring(step, carry=["latents"], **options).run({"latents": latents},
                                                               per_step={"c": cs})
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=tp.backend(**options), dynamic=False)
    x = latents
    with torch.no_grad():
        for c in cs:
            (x,) = compiled(x, c)
    assert_rel_close(ring, x)


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_diffusers_transformer_2d_with_group_norm(mode):
    """Continuous-input Transformer2DModel: a GroupNorm over channels x every latent row
    before its blocks. Stale on a repeated input is exact: the stale partials are fresh."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.Transformer2DModel(num_attention_heads=2, attention_head_dim=8,
                                         in_channels=4, norm_num_groups=2, num_layers=1).eval()
    x = torch.randn(1, 4, ROWS, ROWS)
    t = trace(model, x)
    p = t.program(mode=mode, stages=2, chunks=4, warmup_steps=1)
    assert len(p.plan.caches) == (2 if mode == "stale" else 1)  # self-attention K/V, the norm
    with torch.no_grad():
        expected = model(x)[0]
        for _ in range(2):
            assert_rel_close(p(*t.args(hidden_states=x))[0], expected)


@pytest.mark.parametrize("case, said", [
    ("mean", "1 sum(s) over tokens and 0 convolution(s) across rows"),
    ("linear_attention", "2 sum(s) over tokens and 0 convolution(s) across rows"),
    ("row_conv", "0 sum(s) over tokens and 1 convolution(s) across rows"),
])
def test_the_plan_counts_what_is_stale_beyond_attention(case, said):
    """print(plan) names the stale token mixers that weigh more on the drift than keys."""
    *_, program, _, _ = setup(case, mode="stale", stages=2)
    assert f"stale beyond attention: {said}" in str(program.plan)


class PatchGridConv(nn.Module):
    """A 3x3 'same' convolution on the token grid after a 2x2 patchify: a grid row is two
    latent rows (a unit of the grid, once annotate scales it)."""

    def __init__(self, padding: int | str):
        super().__init__()
        self.embed = nn.Conv2d(4, 8, 2, stride=2)
        self.depth = nn.Conv2d(8, 8, 3, padding=padding, groups=8)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        h = self.embed(latents)
        b, d, rows, cols = h.shape
        tokens = h.flatten(2).transpose(1, 2)
        grid = tokens.transpose(1, 2).reshape(b, d, rows, cols)
        return tokens + self.depth(grid).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("padding", [1, "same"])
def test_a_same_convolution_on_a_patchified_grid_is_chunked(padding):
    """Refused before, as reaching across chunk rows, though 'same': its rows were half a
    unit of the latent's until annotate scaled them (and padding='same' read as unknown)."""
    torch.manual_seed(0)
    model = PatchGridConv(padding).eval()
    latents = torch.randn(1, 4, 2 * ROWS, 2 * ROWS)
    t = trace(model, latents)
    p = t.program(mode="stale", stages=2, chunks=4, warmup_steps=1, compiler="eager")
    assert "0 sum(s) over tokens and 1 convolution(s) across rows" in str(p.plan)
    with torch.no_grad():
        expected = model(latents)
        for _ in range(3):  # warmup, then the stale halo rows of the same input: exact
            assert_rel_close(p(*t.args(latents=latents))[0], expected)


class ExpandedContext(nn.Module):
    """A global context (a mean over tokens) spread over the tokens by expand_as."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin, self.ctx = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + self.ctx(h.mean(1, keepdim=True)).expand_as(h)


def test_a_mean_over_tokens_expanded_as_the_tokens_is_chunked():
    """Refused before ("operands carry tokens on different axes or segments"), though the
    same sum broadcast without expand_as ran."""
    torch.manual_seed(0)
    model = ExpandedContext().eval()
    x = torch.randn(1, ROWS, 16)
    t = trace(model, x)
    p = t.program(mode="stale", stages=1, chunks=CHUNKS, warmup_steps=1, compiler="eager")
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):  # warmup, then the stale sums of the same input: exact
            assert_rel_close(p(*t.args(x=x))[0], expected)


@pytest.mark.parametrize("case, said", [("row_conv", "convolves across rows"),
                                        ("mean", "sums over tokens")])
def test_assert_equivalent_says_why_it_leaves_stale_semantics_unchecked(case, said):
    """A convolution across rows was reported as a sum over tokens."""
    from tokpipe_compiler.testing import assert_equivalent

    torch.manual_seed(0)
    model_class, _, shape, _ = CASES[case]
    report = assert_equivalent(model_class().eval(), (torch.randn(shape),), stages=2,
                               chunks=CHUNKS, mode="stale")
    assert any(said in u for u in report.unchecked), str(report)
