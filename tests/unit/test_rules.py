"""The token rule tables on hand-built FX graphs (no Dynamo): each test builds a few nodes
with real example values, gives the inputs a TokenInfo and asks the merged table."""

from __future__ import annotations

import operator
from fractions import Fraction

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from tests.fixtures.fx_graphs import Graph, tok
from tokpipe_compiler.core.args import SDPA, arg, bound_args, varargs
from tokpipe_compiler.core.meta import (
    ATTENTION,
    INVARIANT_INFO,
    SLICES_KEY,
    TOKEN,
    TOKEN_SUM,
    UNSUPPORTED,
    TokenInfo,
)
from tokpipe_compiler.core.ops import RuleCrashed, merge_tables
from tokpipe_compiler.passes import compute_rules, view_rules
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.passes.rule_base import registrar
from tokpipe_compiler.passes.rules import RULES

# -- views and layout --------------------------------------------------------------------------


def test_view_merging_rows_moves_the_token_axis_and_scales_per_unit():
    g = Graph()
    x = g.input("x", (1, 4, 8, 8), tok(2))  # latent rows
    assert g.infer(g.method("view", x, 1, 4, 64)) == tok(2, 8)
    y = g.input("y", (1, 16, 4, 8), tok(1))
    assert g.infer(g.call(torch.reshape, y, shape=(1, 64, 8))) == tok(1, 4)
    assert g.infer(g.method("unsqueeze", y, 0)) == tok(2)


def test_size_one_factors_in_a_view_leave_the_token_axis_on_the_real_rows():
    """Z-Image's patchify of one frame: [C, F=1, H, W] -> [C, F, pF=1, H/2, 2, W/2, 2]."""
    g = Graph()
    image = g.input("image", (4, 1, 8, 16), tok(2))  # rows: a one-frame video seeds on H
    info = g.infer(g.method("view", image, 4, 1, 1, 4, 2, 8, 2))
    assert info == TokenInfo(TOKEN, 3, Fraction(1, 2))
    frame = g.input("frame", (4, 1, 8, 16), tok(1))  # the frame axis: one row, no chunks
    assert "collapses to size 1" in g.infer(g.method("view", frame, 4, 1, 1, 4, 2, 8, 2)).reason


def test_merging_the_batch_outside_the_tokens_records_outer_blocks():
    g = Graph()
    x = g.input("x", (2, 8, 16), tok(1))
    merged = g.method("view", x, 16, 16)  # batch 2 merged outside the tokens
    info = g.infer(merged)
    assert info == TokenInfo(TOKEN, 0, 1, outer=2)
    assert info.extent(3) == 6  # three units in each of the two blocks
    assert g.infer(g.method("view", merged, 2, 8, 16)) == tok(1)  # split back: outer 1


def test_video_batch_merged_with_frames_and_split_back():
    """Latte: [B, C, F, H, W] -permute-> [B, F, C, H, W] -> [B * F, C, H, W], then the
    spatial tokens [B * F, H * W, D] -> [B, F, H * W, D] for temporal attention."""
    g = Graph()
    x = g.input("x", (2, 3, 4, 8, 8), tok(2))  # frames are the tokens
    p = g.method("permute", x, 0, 2, 1, 3, 4)
    assert g.infer(p) == tok(1)
    assert g.infer(g.method("reshape", p, -1, 3, 8, 8)) == TokenInfo(TOKEN, 0, 1, outer=2)
    tokens = g.input("t", (8, 64, 16), TokenInfo(TOKEN, 0, 1, outer=2))
    assert g.infer(g.method("reshape", tokens, 2, 4, 64, 16)) == tok(1)
    flat = g.infer(g.method("flatten", tokens, 0, 1))  # [B * F * HW, D]: per frame 64 rows
    assert flat == TokenInfo(TOKEN, 0, 64, outer=2)


def test_merges_that_cut_through_the_blocks_are_unsupported():
    g = Graph()
    x = g.input("x", (2, 6, 4), tok(1))
    info = g.infer(g.method("view", x, 3, 4, 4))  # rows of 4 straddle the two blocks of 6
    assert info.kind == UNSUPPORTED and "inner factor of a merged axis" in info.reason
    y = g.input("y", (12, 4), TokenInfo(TOKEN, 0, 1, outer=2))
    assert g.infer(g.call(operator.getitem, y, (slice(0, 3),))).kind == UNSUPPORTED


def test_attention_over_a_sequence_of_several_batch_rows_is_unsupported():
    g = Graph()
    info = TokenInfo(TOKEN, 2, 1, outer=2)  # [1, heads, B * L, d]: rows of two batch items
    q, k, v = (g.input(n, (1, 2, 16, 8), info) for n in "qkv")
    out = g.infer(g.call(F.scaled_dot_product_attention, q, k, v))
    assert out.kind == UNSUPPORTED and "rows are an inner factor" in out.reason
    assert "the batch rows or the frames" in out.reason


def test_transpose_and_permute_follow_the_token_axis():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    assert g.infer(g.method("transpose", x, 1, 2)) == tok(2)
    assert g.infer(g.call(torch.transpose, x, dim0=1, dim1=-1)) == tok(2)
    assert g.infer(g.method("permute", x, 0, 2, 1)) == tok(2)
    assert g.infer(g.method("permute", x, (2, 1, 0))) == tok(1)
    assert g.infer(g.call(torch.permute, x, dims=(1, 0, 2))) == tok(0)


def test_transposing_attributes_and_pixel_shuffles_follow_the_token_axis():
    """Dynamo records `k.mT` as getattr(k, "mT"); pixel_shuffle is an unpatchify."""
    g = Graph()
    k = g.input("k", (1, 2, 16, 8), tok(2))
    assert g.infer(g.call(getattr, k, "mT")) == tok(3)
    assert "attribute '.real'" in g.infer(g.call(getattr, k, "real")).reason
    x = g.input("x", (1, 16, 8, 6), TokenInfo(TOKEN, 2, 1, lead=2))
    assert g.infer(g.call(F.pixel_shuffle, x, 2)) == TokenInfo(TOKEN, 2, 2, lead=4)
    unshuffled = g.infer(g.call(F.pixel_unshuffle, x, downscale_factor=2))
    assert unshuffled == TokenInfo(TOKEN, 2, Fraction(1, 2), lead=1)
    assert "as channels" in g.infer(g.call(F.pixel_shuffle, g.input("c", (1, 16, 8, 6), tok(1)),
                                           2)).reason


def test_a_position_outside_the_chunked_tokens_is_a_whole_value():
    """A class token (lead 1) or a register token (trail 1) read by position."""
    g = Graph()
    x = g.input("x", (2, 18, 8), TokenInfo(TOKEN, 1, 4, lead=1, trail=1))
    for at in (0, -1):
        assert g.infer(g.call(operator.getitem, x, (slice(None), at))) == TokenInfo(
            TOKEN, 0, 0, lead=2)  # [2, 8]: the batch axis, held whole
    info = g.infer(g.call(operator.getitem, x, (slice(None), 5)))
    assert info.kind == UNSUPPORTED and "one of the chunked tokens [1, 17)" in info.reason


def test_repeat_keeps_the_token_axis_where_its_factor_is_one():
    """Grouped-query K/V heads (Lumina-Next): k.unsqueeze(3).repeat(1, 1, 1, n_rep, 1)."""
    g = Graph()
    k = g.input("k", (1, 16, 1, 1, 8), tok(1))
    assert g.infer(g.method("repeat", k, 1, 1, 1, 2, 1)) == tok(1)
    assert g.infer(g.method("repeat", k, (1, 1, 1, 1, 1))) == tok(1)  # n_rep 1
    assert g.infer(g.method("repeat", k, 3, 1, 1, 1, 2, 1)) == tok(2)  # a new leading dim
    assert g.infer(g.call(torch.tile, k, (2, 1))) == tok(1)  # sizes of the last dims only
    assert g.infer(g.method("repeat_interleave", k, 2, dim=3)) == tok(1)
    assert g.infer(g.method("repeat_interleave", k, 2, dim=1)) == tok(1, 2)  # in place


def test_repeat_along_the_token_axis_is_refused_naming_the_op():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    info = g.infer(g.method("repeat", x, 1, 2, 1))
    assert info.kind == UNSUPPORTED and info.reason.startswith("repeat x2 along the token axis")
    info = g.infer(g.call(torch.tile, x, (3, 1)))  # (3, 1) tiles the last two dims
    assert info.kind == UNSUPPORTED and info.reason.startswith("tile x3 along the token axis")
    n_rep = g.graph.placeholder("n_rep")  # a size Dynamo keeps symbolic
    n_rep.meta["example_value"], g.infos[n_rep] = 1, INVARIANT_INFO
    info = g.infer(g.method("repeat", x, 1, n_rep, 1))
    assert info.kind == UNSUPPORTED and "sizes computed in the graph" in info.reason


def test_expand_keeps_the_token_axis_and_refuses_to_broadcast_it():
    g = Graph()
    x = g.input("x", (1, 16, 1, 8), tok(1))
    assert g.infer(g.method("expand", x, 2, 2, 16, 3, 8)) == tok(2)
    assert g.infer(g.method("expand", x, -1, -1, 4, -1)) == tok(1)
    whole = g.input("w", (1, 8), TokenInfo(TOKEN, 0, 0, lead=1))  # sync's whole value
    info = g.infer(g.method("expand", whole, 2, 8))
    assert info.kind == UNSUPPORTED and "broadcasts the token axis" in info.reason


def test_pad_sequence_of_equal_lengths_stacks_the_token_layout():
    """Z-Image pads its one sequence per batch item into a batch: a stack."""
    g = Graph()
    a, b = g.input("a", (16, 8), tok(0)), g.input("b", (16, 8), tok(0))
    pad = torch.nn.utils.rnn.pad_sequence
    assert g.infer(g.call(pad, [a], batch_first=True)) == tok(1)
    assert g.infer(g.call(pad, [a, b])) == tok(0)  # [L, B, D]
    assert g.infer(g.call(torch._C._nn.pad_sequence, [a, b], True, 0.0)) == tok(1)
    h = g.input("h", (3, 16), tok(1))  # padded along axis 0, which is not the token axis
    h5 = g.input("h5", (5, 16), tok(1))
    assert g.infer(g.call(pad, [h, h5], batch_first=True)) == tok(2)


def test_pad_sequence_refuses_to_pad_the_token_axis_or_mix_layouts():
    g = Graph()
    pad = torch.nn.utils.rnn.pad_sequence
    a, text = g.input("a", (16, 8), tok(0)), g.input("text", (16, 8))
    info = g.infer(g.call(pad, [a, text], batch_first=True))
    assert info.kind == UNSUPPORTED and "differently (or not at all)" in info.reason
    short, long = g.input("s", (12, 8), tok(0)), g.input("l", (16, 8), tok(0))
    info = g.infer(g.call(pad, [short, long], batch_first=True))
    assert info.kind == UNSUPPORTED and "pads the token axis" in info.reason


# -- compute -----------------------------------------------------------------------------------


def test_linear_keeps_the_token_axis_and_refuses_to_contract_it():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    w = g.input("w", (12, 8))
    assert g.infer(g.call(F.linear, x, w)) == tok(1)
    xt = g.input("xt", (1, 8, 16), tok(2))
    w16 = g.input("w16", (12, 16))
    info = g.infer(g.call(F.linear, xt, w16))
    assert info.kind == UNSUPPORTED and "contracts over the token axis" in info.reason


def test_a_transposed_convolution_with_kernel_equal_to_stride_scales_the_rows():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(2))  # [B, C, L]
    w = g.input("w", (16, 4, 2))
    assert g.infer(g.call(torch.conv_transpose1d, x, w, None, 2)) == tok(2, 2)
    w3 = g.input("w3", (16, 4, 3))
    info = g.infer(g.call(torch.conv_transpose1d, x, w3, None, 1, 1))
    assert info.kind == UNSUPPORTED and "reaches across chunk rows" in info.reason


def test_layer_norm_over_hidden_keeps_tokens_over_tokens_does_not():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    assert g.infer(g.call(F.layer_norm, x, (8,))) == tok(1)
    assert g.infer(g.call(F.layer_norm, x, normalized_shape=(8,))) == tok(1)
    info = g.infer(g.call(F.layer_norm, x, (16, 8)))
    assert info.kind == UNSUPPORTED and "normalises over the token axis" in info.reason


def test_self_attention_is_marked_attention_cross_attention_is_not():
    g = Graph()
    q, k, v = (g.input(n, (1, 2, 16, 8), tok(2)) for n in "qkv")
    out = g.call(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert g.infer(out) == TokenInfo(ATTENTION, 2, 1)
    ctx_k, ctx_v = g.input("ck", (1, 2, 5, 8)), g.input("cv", (1, 2, 5, 8))
    assert g.infer(g.call(F.scaled_dot_product_attention, q, ctx_k, ctx_v)) == tok(2)


def test_a_token_mask_over_queries_and_keys_without_tokens_is_unsupported():
    """Text attending to text under a mask computed from the image tokens: every output
    depends on every token (the rule crashed on the queries' missing token axis)."""
    g = Graph()
    q, k, v = (g.input(n, (1, 2, 5, 8)) for n in "qkv")
    mask = g.input("mask", (1, 1, 5, 5), TokenInfo(TOKEN_SUM, 2, 1))
    info = g.infer(g.call(F.scaled_dot_product_attention, q, k, v, attn_mask=mask))
    assert info.kind == UNSUPPORTED and "mask computed from the tokens" in info.reason


def test_a_cross_attention_mask_with_a_row_per_query_is_cut_to_the_chunk():
    """Lumina-Next expands its text mask over every query: [B, heads, L, text]."""
    g = Graph()
    q = g.input("q", (1, 2, 16, 8), tok(2))
    ck, cv = g.input("ck", (1, 2, 5, 8)), g.input("cv", (1, 2, 5, 8))
    mask = g.input("mask", (1, 2, 16, 5))
    node = g.call(F.scaled_dot_product_attention, q, ck, cv, attn_mask=mask)
    assert g.infer(node) == tok(2)
    assert node.meta[SLICES_KEY] == [(mask, 2, tok(2))]
    per_key = g.call(F.scaled_dot_product_attention, q, ck, cv, attn_mask=g.input("m", (1, 5)))
    assert g.infer(per_key) == tok(2) and SLICES_KEY not in per_key.meta  # one row for all


def test_mean_over_the_token_axis_is_a_partial_sum_over_hidden_it_is_kept():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    info = g.infer(g.method("mean", x, 1))
    assert info.kind == TOKEN_SUM and info.per_unit == 0  # every chunk holds all of it
    info = g.infer(g.method("amax", x, 1))
    assert info.kind == UNSUPPORTED and "over the token axis mixes tokens" in info.reason
    assert g.infer(g.call(torch.mean, x, dim=-1)) == tok(1)
    assert g.infer(g.method("mean", x, 0)) == tok(0)
    assert g.infer(g.method("mean", x, 0, keepdim=True)) == tok(1)


def test_norms_read_their_dim_after_the_order():
    """A norm's order comes before its dim (`x.norm(2, -1)`, `torch.linalg.vector_norm(x, 2,
    -1, True)`): per token over the channels keeps the axis, over the tokens mixes them.
    QwenImage's guidance rescales by `torch.norm(pred, dim=-1, keepdim=True)`."""
    g = Graph()
    x = g.input("x", (2, 16, 8), tok(1))
    assert g.infer(g.method("norm", x, 2, -1)) == tok(1)
    assert g.infer(g.method("norm", x, 2, 0)) == tok(0)  # the batch reduced away
    assert g.infer(g.call(torch.norm, x, dim=-1, keepdim=True)) == tok(1)
    assert g.infer(g.call(torch.linalg.vector_norm, x, 2, -1, True)) == tok(1)
    assert g.infer(g.call(torch.linalg.vector_norm, x, 2, 0)) == tok(0)
    over_tokens = g.infer(g.call(torch.linalg.vector_norm, x, 2, 1))
    assert over_tokens.kind == UNSUPPORTED and "mixes tokens" in over_tokens.reason
    assert g.infer(g.call(torch.var, x, -1, True, True)) == tok(1)  # unbiased, then keepdim


def test_cat_along_another_axis_keeps_the_layout():
    g = Graph()
    a, b = g.input("a", (1, 16, 8), tok(1)), g.input("b", (1, 16, 4), tok(1))
    assert g.infer(g.call(torch.cat, [a, b], dim=-1)) == tok(1)
    assert g.infer(g.call(torch.cat, [a, b], 2)) == tok(1)


# -- the tables and their merge ----------------------------------------------------------------


def test_merge_rejects_an_op_defined_twice():
    with pytest.raises(ValueError, match=r"'views'.*'compute'"):
        merge_tables({"views": {F.linear: view_rules.elementwise},
                      "compute": {F.linear: compute_rules.linear}})
    assert merge_tables({"a": {F.linear: compute_rules.linear}, "b": {F.silu: len}}) == {
        F.linear: compute_rules.linear, F.silu: len}


def test_a_table_rejects_two_rules_for_one_op():
    table: dict = {}
    register = registrar(table)
    register(F.linear, torch._C._nn.linear)(compute_rules.linear)  # aliases of one rule
    with pytest.raises(ValueError, match="two rules"):
        register(F.linear)(compute_rules.matmul)


def test_merged_table_holds_every_module_table_under_op_keys():
    assert RULES[F.linear] is compute_rules.linear
    assert RULES["method:view"] is view_rules.reshape
    assert RULES[operator.getitem].__name__ == "getitem"
    assert "view" not in RULES and "linear" not in RULES  # keyed by op, not by name


# -- a rule that crashes -----------------------------------------------------------------------


def test_a_crashing_rule_raises_naming_the_op_instead_of_unsupported():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    bad = g.graph.call_method("transpose", (x, 1))  # dim1 missing: the rule cannot read it
    bad.meta["example_value"] = torch.randn(1, 8, 16)
    g.graph.output(bad)
    gm = torch.fx.GraphModule(torch.nn.Module(), g.graph)
    with pytest.raises(RuleCrashed, match="token rule for 'transpose'") as caught:
        annotate(gm, "x")
    assert caught.value.node is bad and caught.value.op == "transpose"
    assert isinstance(caught.value.__cause__, TypeError)
    assert "transpose((1, 16, 8))" in str(caught.value)  # describe(node)


# -- the argument reader -----------------------------------------------------------------------


def test_arg_reads_position_then_keyword_then_default():
    g = Graph()
    x = g.input("x", (1, 16, 8), tok(1))
    node = g.call(torch.cat, [x, x], dim=2)
    assert arg(node, 1, "dim", 0) == 2 and arg(node, 0, "tensors") == [x, x]
    assert arg(g.call(torch.cat, [x, x]), 1, "dim", 0) == 0
    assert varargs(g.method("permute", x, (0, 2, 1)), 1) == (0, 2, 1)
    sdpa = g.call(F.scaled_dot_product_attention, x, x, x, None, 0.0, is_causal=True)
    assert bound_args(sdpa, SDPA) == {"query": x, "key": x, "value": x, "attn_mask": None,
                                      "dropout_p": 0.0, "is_causal": True}
    with pytest.raises(TypeError, match="positional arguments"):
        bound_args(sdpa, SDPA[:3])
