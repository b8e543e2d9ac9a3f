"""Attention written by hand (diffusers' classic AttnProcessor: baddbmm, softmax, bmm; or
matmuls, a scale and a mask) is folded into scaled_dot_product_attention before annotate
(`passes/attention_patterns.py`), so stale mode chunks it with K/V caches (PyTorch's fused
attention modules: tests/compiler/test_torch_attention.py).

Tolerance: float32, max |folded - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures.tracing import assert_rel_close, quiet_program, second_call, trace
from tokpipe_compiler.passes.attention_patterns import fold_hand_written_attention

B, HEADS, N, D = 2, 2, 16, 8


def classic(q, k, v, bias):
    """diffusers' AttnProcessor: scores by baddbmm over an empty tensor (beta 0)."""
    empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)
    scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=D ** -0.5)
    return torch.bmm(scores.softmax(dim=-1), v)


def classic_masked_upcast(q, k, v, bias):
    """A mask as baddbmm's input (beta 1), the softmax upcast and cast back."""
    scores = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=1, alpha=D ** -0.5)
    return torch.bmm(scores.float().softmax(dim=-1).to(q.dtype), v)


def scaled_matmul_masked(q, k, v, bias):
    """Four-dimensional heads: matmul times a scale plus a mask, an evaluation dropout."""
    q4, k4, v4 = (t.view(B, HEADS, N, D) for t in (q, k, v))
    scores = torch.matmul(q4, k4.transpose(-2, -1)) * (1 / math.sqrt(D)) + bias.view(B, HEADS, 1, N)
    probs = F.dropout(F.softmax(scores, dim=-1), p=0.1, training=False)
    return (probs @ v4).reshape(B * HEADS, N, D)


def divided(q, k, v, bias):
    scores = (q @ k.transpose(1, 2)) / math.sqrt(D)
    return torch.matmul(torch.softmax(scores, -1), v)


def keys_given_transposed(q, k, v, bias):
    """The keys arrive as [.., E, S]: the fold transposes them back."""
    keys_t = k.permute(0, 2, 1).contiguous()
    return torch.bmm(torch.baddbmm(bias, q, keys_t, beta=1, alpha=0.5).softmax(-1), v)


def einsum_scaled(q, k, v, bias):
    """The latent-diffusion spelling: einsums with named axes."""
    scores = torch.einsum("b i d, b j d -> b i j", q, k) * D ** -0.5
    return torch.einsum("b i j, b j d -> b i d", scores.softmax(dim=-1), v)


def einsum_heads_masked(q, k, v, bias):
    q4, k4, v4 = (t.view(B, HEADS, N, D) for t in (q, k, v))
    scores = torch.einsum("...qd,...kd->...qk", q4, k4) + bias.view(B, HEADS, 1, N)
    return torch.einsum("...qk,...kd->...qd", scores.softmax(-1), v4).reshape(B * HEADS, N, D)


def einsum_heads_after_tokens(q, k, v, bias):
    """x-transformers' layout, [B, N, H, D]: permuted to sdpa's [B, H, N, D] and back."""
    q4, k4, v4 = (t.view(B, HEADS, N, D).transpose(1, 2) for t in (q, k, v))
    scores = torch.einsum("bnhd,bmhd->bhnm", q4, k4) * D ** -0.5
    out = torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v4)
    return out.transpose(1, 2).reshape(B * HEADS, N, D)


def einsum_keys_first_masked(q, k, v, bias):
    """The keys as the first operand and the values as the first: the letters tell them."""
    scores = torch.einsum("b j d, b i d -> b i j", k, q) + bias
    return torch.einsum("b j d, b i j -> b i d", v, scores.softmax(-1))


def keys_by_mT(q, k, v, bias):
    """`k.mT`, which Dynamo records as getattr(k, "mT"), with the softmax upcast."""
    scores = torch.matmul(q, k.mT) / math.sqrt(D)
    return torch.matmul(F.softmax(scores.float(), dim=-1).to(q.dtype), v)


def masked_fill_causal(q, k, v, bias):
    """nanoGPT's spelling: scores filled with -inf where a lower-triangular table is 0."""
    table = torch.tril(torch.ones(N, N)).view(1, N, N)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    return F.softmax(scores.masked_fill(table == 0, float("-inf")), dim=-1) @ v


def masked_fill_lowest(q, k, v, bias):
    """transformers' eager spelling (MPT, BLOOM): the dtype's lowest value, not -inf; the
    last query row has every key filled, and stays even as in eager."""
    hidden = (torch.arange(N)[None, :] > torch.arange(N)[:, None]) | \
        (torch.arange(N)[:, None] == N - 1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    return F.softmax(scores.masked_fill(hidden, torch.finfo(q.dtype).min), dim=-1) @ v


def where_seen_lowest_plus_mask(q, k, v, bias):
    """GPT-Neo's spelling: torch.where(seen, scores, torch.tensor(lowest)) plus an added
    padding mask; the last query row sees no key, and stays even as in eager."""
    seen = (torch.arange(N)[None, :] <= torch.arange(N)[:, None]) & \
        (torch.arange(N)[:, None] != N - 1)
    lowest = torch.tensor(torch.finfo(q.dtype).min, dtype=q.dtype)
    return F.softmax(torch.where(seen, q @ k.transpose(-2, -1), lowest) + bias, dim=-1) @ v


def alibi_under_lowest(q, k, v, bias):
    """MPT's spelling: a per-key position bias added to the scores, then the dtype's
    lowest value filled where a causal table hides the key."""
    hidden = torch.arange(N)[None, :] > torch.arange(N)[:, None]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D)) + bias * 0.01
    return F.softmax(scores.masked_fill(hidden, torch.finfo(q.dtype).min), dim=-1) @ v


def alibi_under_lowest_padded(q, k, v, bias):
    """An added mask that holds the lowest value itself (padded keys) under a fill of it:
    the last row, every key hidden, stays even only if the fill replaces the mask there
    (their sum would overflow to -inf at the padded keys)."""
    hidden = (torch.arange(N)[None, :] > torch.arange(N)[:, None]) | \
        (torch.arange(N)[:, None] == N - 1)
    lowest = torch.finfo(q.dtype).min
    scores = (q @ k.transpose(-2, -1)) + bias.masked_fill(bias < -1, lowest)
    return F.softmax(scores.masked_fill(hidden, lowest), dim=-1) @ v


def where_hidden_bfloat16_fill(q, k, v, bias):
    """torch.where(hidden, fill, scores) with the float32 lowest value made a bfloat16
    tensor: -inf there, so the last row, every key hidden, is NaN in eager as in sdpa."""
    hidden = torch.arange(N)[None, :] > torch.arange(N)[:, None]
    fill = torch.tensor(torch.finfo(torch.float32).min, dtype=torch.bfloat16)
    return F.softmax(torch.where(hidden, fill, q @ k.transpose(-2, -1)), dim=-1) @ v


def where_hidden_inf(q, k, v, bias):
    """torch.where(hidden, -inf, scores): the table marks what may not be attended."""
    hidden = torch.arange(N)[None, :] > torch.arange(N)[:, None]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    return F.softmax(torch.where(hidden, float("-inf"), scores), dim=-1) @ v


def where_method_inf(q, k, v, bias):
    """scores.where(seen, -inf): sdpa gets the table itself as its boolean mask."""
    seen = torch.arange(N)[None, :] <= torch.arange(N)[:, None]
    return F.softmax((q @ k.transpose(-2, -1)).where(seen, float("-inf")), dim=-1) @ v


def chained(q, k, v, bias):
    """Two attentions, the first's output the second's queries: each folded in turn."""
    first = torch.bmm(torch.bmm(q, k.transpose(-1, -2)).softmax(-1), v)
    return torch.bmm(torch.bmm(first, k.transpose(-1, -2)).softmax(-1), v)


def scores_returned(q, k, v, bias):
    scores = torch.bmm(q, k.transpose(-1, -2))
    return torch.bmm(scores.softmax(-1), v), scores


def softmax_over_queries(q, k, v, bias):
    return torch.bmm(torch.bmm(q, k.transpose(-1, -2)).softmax(dim=1), v)


def half_beta(q, k, v, bias):
    return torch.bmm(torch.baddbmm(bias, q, k.transpose(-1, -2), beta=0.5).softmax(-1), v)


def double_mask(q, k, v, bias):
    return torch.bmm((torch.bmm(q, k.transpose(-1, -2)) + bias.double()).softmax(-1).float(), v)


def einsum_over_queries(q, k, v, bias):
    """Scores laid out [keys, queries]: the softmax normalises over queries."""
    scores = torch.einsum("bid,bjd->bji", q, k)
    return torch.einsum("bji,bjd->bid", scores.softmax(-1), v)


def masked_fill_finite(q, k, v, bias):
    """Filled with a finite value: a row with every key masked attends to all of them
    evenly, where sdpa's mask would give NaN."""
    scores = (q @ k.transpose(-2, -1)).masked_fill(bias < -1, -1e9)
    return scores.softmax(-1) @ v


def where_finite(q, k, v, bias):
    """torch.where with a finite fill other than the dtype's lowest: left as written."""
    seen = torch.arange(N)[None, :] <= torch.arange(N)[:, None]
    return torch.where(seen, q @ k.transpose(-2, -1), torch.tensor(-1e9)).softmax(-1) @ v


def einsum_heads_last_masked(q, k, v, bias):
    """Scores laid out [B, N, H, M] with a mask added: sdpa's mask would need permuting."""
    q4, k4, v4 = (t.view(B, HEADS, N, D).transpose(1, 2) for t in (q, k, v))
    scores = torch.einsum("bnhd,bmhd->bnhm", q4, k4) + bias.view(B, 1, HEADS, N)
    out = torch.einsum("bnhm,bmhd->bnhd", scores.softmax(-1), v4)
    return out.transpose(1, 2).reshape(B * HEADS, N, D)


def probabilities_read_twice(q, k, v, bias):
    probs = torch.bmm(q, k.transpose(-1, -2)).softmax(-1)
    return torch.bmm(probs, v) + probs.sum()


def per_head_temperature(q, k, v, bias):
    """Swin v2's learned temperature: one factor per head (here made from the bias)."""
    temperature = (bias[:, :, :1] * 0 + 0.7).exp()
    return ((q @ k.transpose(-2, -1)) * temperature).softmax(-1) @ v


def divided_by_a_tensor(q, k, v, bias):
    return (torch.bmm(q, k.transpose(-1, -2)) / (bias.sum() * 0 + 4.0)).softmax(-1) @ v


def per_query_factor(q, k, v, bias):
    """A factor per query row is no temperature: left as written."""
    return ((q @ k.transpose(-2, -1)) * q[:, :, :1].sigmoid()).softmax(-1) @ v


class Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B * HEADS, N, D) for _ in range(3))
    bias = torch.zeros(B * HEADS, 1, N)
    bias[:, :, N - 3:] = -10000.0  # three padded keys
    return q, k, v, bias


def graph_ops(gm: torch.fx.GraphModule) -> set[str]:
    return {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")}


@pytest.mark.parametrize("fn", [classic, classic_masked_upcast, scaled_matmul_masked, divided,
                                keys_given_transposed, einsum_scaled, einsum_heads_masked,
                                einsum_heads_after_tokens, einsum_keys_first_masked, keys_by_mT,
                                masked_fill_causal, masked_fill_lowest, chained,
                                where_seen_lowest_plus_mask, alibi_under_lowest,
                                alibi_under_lowest_padded, where_hidden_bfloat16_fill,
                                where_hidden_inf,
                                where_method_inf,
                                per_head_temperature,
                                divided_by_a_tensor])
def test_hand_written_attention_becomes_sdpa_of_the_same_value(fn):
    args = inputs()
    traced = trace(Wrap(fn), *args)
    assert fold_hand_written_attention(traced.gm) == (2 if fn is chained else 1)
    ops = graph_ops(traced.gm)
    assert "scaled_dot_product_attention" in ops
    assert not ops & {"softmax", "baddbmm", "bmm", "empty", "einsum", "getattr", "where",
                      "tensor"}, ops
    assert "masked_fill" not in ops or fn in (
        masked_fill_lowest, where_seen_lowest_plus_mask, alibi_under_lowest,
        alibi_under_lowest_padded), ops  # builds its mask
    assert_rel_close(traced.gm(*traced.args())[0], fn(*args))


@pytest.mark.parametrize("fn", [scores_returned, softmax_over_queries, half_beta, double_mask,
                                einsum_over_queries, masked_fill_finite, where_finite,
                                einsum_heads_last_masked, probabilities_read_twice,
                                per_query_factor])
def test_what_is_not_exactly_attention_is_left_as_written(fn):
    traced = trace(Wrap(fn), *inputs())
    before = [n.format_node() for n in traced.gm.graph.nodes]
    assert fold_hand_written_attention(traced.gm) == 0
    assert [n.format_node() for n in traced.gm.graph.nodes] == before


class ClassicBlocks(nn.Module):
    """Two blocks of self-attention in diffusers' classic form, heads folded into the batch
    (head_to_batch_dim), each with a residual and an MLP."""

    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
            q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3)
                       .reshape(b * self.heads, n, -1) for t in qkv(x).chunk(3, dim=-1))
            empty = torch.empty(q.shape[0], n, n, dtype=q.dtype)
            scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0,
                                   alpha=q.shape[-1] ** -0.5)
            out = torch.bmm(scores.softmax(dim=-1), v)
            x = x + out.reshape(b, self.heads, n, -1).permute(0, 2, 1, 3).reshape(b, n, c)
            x = x + mlp(x)
        return x


@pytest.mark.parametrize("mode", ["sync", "stale", "causal"])
def test_classic_blocks_pipeline_with_kv_caches(mode):
    """Stale chunks each block's attention with K/V caches; on the second call every chunk
    sees the first call's K/V of the same input, so it equals eager. Causal refuses it as
    it refuses the same attention through sdpa (it attends to the whole sequence)."""
    torch.manual_seed(0)
    model = ClassicBlocks().eval()
    x = torch.randn(2, 16, 32)
    traced = trace(model, x)
    if mode == "causal":
        with pytest.raises(Exception, match="needs causal attention"):
            quiet_program(traced, mode=mode, chunks=4)
        return
    program = quiet_program(traced, mode=mode, chunks=4, warmup_steps=1)
    assert len(program.plan.caches) == 2  # each block's attention through the K/V caches
    with torch.no_grad():
        expected = model(x)
    assert_rel_close(second_call(program, traced), expected)


@pytest.mark.parametrize("name", ["DiTTransformer2DModel", "LatteTransformer3DModel",
                                  "Transformer2DModel"])
def test_diffusers_models_with_the_classic_processor_pipeline_in_stale(name):
    """Each class with diffusers' classic AttnProcessor in every attention (what
    set_default_attn_processor() installs): its blocks' self-attention gets K/V caches,
    and stale on a repeated input equals eager."""
    from diffusers.models.attention_processor import AttnProcessor

    from tests.fixtures.zoo import ZOO, build

    model = build(name)
    for module in model.modules():
        if hasattr(module, "set_processor"):
            module.set_processor(AttnProcessor())
    inputs = ZOO[name].inputs(0)
    traced = trace(model, **inputs)
    program = quiet_program(traced, mode="stale", chunks=ZOO[name].chunks, warmup_steps=1)
    assert program.plan.caches
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
    assert_rel_close(second_call(program, traced), expected)


class CausalBlocks(nn.Module):
    """nanoGPT's blocks: causal attention written by hand, a lower-triangular buffer masking
    the scores with -inf."""

    def __init__(self, width: int = 32, heads: int = 4, context: int = 64, depth: int = 2,
                 fill: float = float("-inf")):
        super().__init__()
        self.heads, self.fill = heads, fill
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("tril", torch.tril(torch.ones(context, context)).view(
            1, 1, context, context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
            q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                       for t in qkv(x).split(c, dim=2))
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            scores = scores.masked_fill(self.tril[:, :, :n, :n] == 0, self.fill)
            out = F.softmax(scores, dim=-1) @ v
            x = x + out.transpose(1, 2).contiguous().view(b, n, c)
            x = x + mlp(x)
        return x


@pytest.mark.parametrize("mode", ["sync", "stale", "causal"])
@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_hand_written_causal_attention_pipelines_in_every_mode(mode, fill):
    """The mask goes to sdpa as a boolean mask (or, filled with the dtype's lowest value as
    transformers fills, an additive one): causal mode runs it chunked and exact on the
    first call (a chunk's keys after its own are masked), stale on a repeated input."""
    torch.manual_seed(0)
    model = CausalBlocks(fill=fill).eval()
    x = torch.randn(2, 32, 32)
    traced = trace(model, x)
    program = quiet_program(traced, mode=mode, chunks=4, warmup_steps=0)
    assert len(program.plan.caches) == 2
    with torch.no_grad():
        expected = model(x)
        first = program(*traced.args())[0]
        second = program(*traced.args())[0]
    if mode != "stale":
        assert_rel_close(first, expected)
    assert_rel_close(second, expected)
