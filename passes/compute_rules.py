"""Token rules for ops that compute: contractions, norms, embeddings and attention (the ops
over the token grid, convolution, pooling, resampling and unfold, are `grid_rules`).
COMPUTE_RULES, merged with the others in `rules.py`."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import SDPA, arg, bound_args, varargs
from tokpipe_compiler.core.fx import node_shape
from tokpipe_compiler.core.meta import ATTENTION, TOKEN, TOKEN_SUM, UNSUPPORTED, TokenInfo
from tokpipe_compiler.passes.attention_einsums import FORMS
from tokpipe_compiler.passes.rule_base import (
    Rule,
    RuleContext,
    first_token,
    mixes_tokens,
    registrar,
    slice_operand,
    source,
    sum_refusal,
    summed,
    unsupported,
)

COMPUTE_RULES: dict[Any, Rule] = {}
register = registrar(COMPUTE_RULES)

# -- contractions ------------------------------------------------------------------------------


@register(F.linear, torch._C._nn.linear)
def linear(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("a linear layer's weight depends on the tokens")
    if info.axis == len(node_shape(src)) - 1:
        return unsupported("a linear layer contracts over the token axis")
    return info


@register(torch.addmm, "method:addmm")
def addmm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """bias + x @ w (GPT-2's Conv1D): a linear layer over the rows of x."""
    bias, rows, weight = source(node), arg(node, 1, "mat1"), arg(node, 2, "mat2")
    info, bias_info = ctx.info(rows), ctx.info(bias) if isinstance(bias, torch.fx.Node) else None
    if isinstance(weight, torch.fx.Node) and ctx.info(weight) is not None and \
            ctx.info(weight).carries_tokens:
        return unsupported("addmm whose weight depends on the tokens")
    if info is None or not info.carries_tokens or info.axis != 0:
        return unsupported("addmm contracts over the token axis")
    if bias_info is not None and bias_info.carries_tokens:  # a residual, row by row
        return info if bias_info == info else \
            unsupported("addmm whose bias carries the tokens otherwise than its rows")
    if isinstance(bias, torch.fx.Node) and len(node_shape(bias)) == 2 and \
            node_shape(bias)[0] != 1:  # a per-row table: each chunk takes its rows
        why = slice_operand(node, bias, 0, info)
        if why:
            return unsupported(f"addmm: {why}")
    return info


@register(operator.matmul, torch.matmul, "method:matmul", torch.bmm, "method:bmm")
@mixes_tokens
def matmul(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    a, b = source(node), arg(node, 1, "other")
    ia, ib = _chunked(ctx.info(a)), _chunked(ctx.info(b))
    if ia is None and ib is None:  # per-chunk values without a chunked range on both sides
        ia, ib = (i if i is not None and i.carries_tokens else None
                  for i in (ctx.info(a), ctx.info(b)))
    out_ndim = len(node_shape(node))
    na, nb = len(node_shape(a)), len(node_shape(b))
    if ia is not None and ib is not None:
        if ia.axis == na - 1 and ib.axis == nb - 2 and ia.per_unit == ib.per_unit:
            return summed(node, ia, "matmul")  # linear attention's K^T V
        return unsupported("matmul of two token tensors that does not contract over their "
                           "common token axis (mixes tokens)")
    if ib is not None:
        if ib.axis == nb - 2:
            return unsupported("matmul contracts over the token axis of an operand whose "
                               "other operand does not carry tokens (mixes tokens)")
        if ib.axis == nb - 1:
            return ib.moved(out_ndim - 1)
        return ib.moved(ib.axis + out_ndim - nb)
    if ia.axis == na - 1:
        return unsupported("matmul contracts over the token axis of an operand whose other "
                           "operand does not carry tokens (mixes tokens)")
    return ia.moved(ia.axis + out_ndim - na)


def _chunked(info: TokenInfo | None) -> TokenInfo | None:
    """`info` when it has a chunked range; a per-chunk value with none (a sum over tokens,
    a text segment) multiplies like a constant."""
    return info if info is not None and info.carries_tokens and info.per_unit else None


@register(torch.einsum, torch.functional.einsum)
def einsum(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    equation = arg(node, 0, "equation").replace(" ", "")
    operands = varargs(node, 1)
    if "..." in equation or "->" not in equation:
        return unsupported("einsum with an implicit output or ellipsis")
    inputs, output = equation.split("->")
    letters = inputs.split(",")
    token_letter = token_info = None
    for spec, operand in zip(letters, operands, strict=True):
        info = ctx.info(operand)
        if info is not None and info.carries_tokens:
            letter = spec[info.axis]
            if token_letter not in (None, letter):
                return unsupported("einsum operands carry tokens on different letters; if it "
                                   f"is attention: {FORMS}")
            token_letter, token_info = letter, info
    if token_letter not in output:
        return unsupported(f"einsum sums over the token index '{token_letter}'; if it is "
                           f"attention: {FORMS}")
    result = token_info.moved(output.index(token_letter))
    for spec, operand in zip(letters, operands, strict=True):
        info = ctx.info(operand)
        if token_letter in spec and info is not None and not info.carries_tokens:
            # a per-token table ("bnd,nd->bnd"): each chunk takes its rows of it
            why = slice_operand(node, operand, spec.index(token_letter), result)
            if why:
                return unsupported(f"einsum: {why}")
    return result


# -- normalisation -----------------------------------------------------------------------------


@register(F.layer_norm, torch.layer_norm, F.rms_norm, torch.rms_norm)
def layer_norm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("a norm's weight depends on the tokens")
    normalized = arg(node, 1, "normalized_shape")
    if info.axis >= len(node_shape(src)) - len(normalized):
        return unsupported("the norm normalises over the token axis")
    return info


@register(F.group_norm, torch.group_norm)
@mixes_tokens
def group_norm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("a norm's weight depends on the tokens")
    if info.axis < 2:
        return unsupported("group_norm over groups of the token axis (mixes tokens)")
    why = sum_refusal(info)
    if why:
        return unsupported(f"group_norm's statistics over the token axis mix tokens: {why}")
    return replace(info, kind=TOKEN_SUM)  # statistics from partial sums, values per token


@register(F.instance_norm, F.batch_norm)
def instance_norm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    return unsupported(f"{node.target.__name__} normalises over all positions (mixes tokens)")


# -- embeddings and attention ------------------------------------------------------------------


@register(F.embedding, torch.embedding)
def embedding(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("an embedding table depends on the tokens")
    return info


@register(F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
@mixes_tokens
def attention(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    args = bound_args(node, SDPA)
    info = _attention(node, args, ctx)
    if info.kind == UNSUPPORTED:
        return info
    why = _mask_refusal(node, args.get("attn_mask"), info, ctx)
    return unsupported(why) if why else info


def _attention(node: torch.fx.Node, args: dict[str, Any], ctx: RuleContext) -> TokenInfo:
    q, k, v = args["query"], args["key"], args["value"]
    iq, ik, iv = ctx.info(q), ctx.info(k), ctx.info(v)
    nd = len(node_shape(q))
    if not (ik.carries_tokens or iv.carries_tokens):
        if not iq.carries_tokens:  # the rule runs for a token mask: it mixes every token in
            return unsupported("an attention mask computed from the tokens, over queries, "
                               "keys and values without them")
        return _cross_attention(node, iq, (k, v))
    if not iq.carries_tokens and ik.carries_tokens and iv.carries_tokens:
        return unsupported("cross-attention from queries without the tokens (another "
                           "stream: an audio track, learned queries) to keys and values "
                           "computed from them: each of its outputs reads every chunk")
    if not (iq.carries_tokens and ik.carries_tokens and iv.carries_tokens):
        return unsupported("attention whose queries, keys and values differ in token use")
    # their layouts: queries that another attention's output gives are laid out as keys
    iq, ik, iv = (replace(i, kind=TOKEN) for i in (iq, ik, iv))
    if len({iq, ik, iv}) == 1 and iq.axis < nd - 2:
        return iq  # tokens on a batch or head axis: each item attends on its own
    if {iq.axis, ik.axis, iv.axis} != {nd - 2}:
        return unsupported("attention whose sequence axis is not the token axis")
    if ik.outer > 1 or iq.outer > 1:
        return unsupported("attention over a sequence in which the grid's rows are an inner "
                           "factor (another axis merged into it, the batch rows or the "
                           "frames, or the tokens reordered, column by column say): a chunk's "
                           "rows are no one range of it")
    if ik != iv or iq not in (ik, replace(ik, lead=0, trail=0)):
        return unsupported("queries and keys of different token granularity or segments")
    return iq.moved(nd - 2, ATTENTION)


def _mask_refusal(node: torch.fx.Node, mask: Any, info: TokenInfo, ctx: RuleContext) -> str:
    """Cuts an invariant mask with a row per query (or per batch item, where the tokens are
    on the batch axis) to the chunk's; why it cannot be, or ''. `info`: the attention's.
    Cross-attention masks too: Lumina-Next expands its text mask to every query."""
    if not isinstance(mask, torch.fx.Node):
        return ""
    if ctx.info(mask).carries_tokens:
        # Chunked with the queries; but K/V from other chunks would need its other columns.
        return "an attention mask computed from the tokens" if info.kind == ATTENTION else ""
    shape = node_shape(mask)
    axis = info.axis - (len(node_shape(node)) - len(shape))  # it broadcasts from the right
    if axis < 0 or shape[axis] == 1:
        return ""
    return slice_operand(node, mask, axis, info)


def _cross_attention(node: torch.fx.Node, iq: TokenInfo, keys: tuple) -> TokenInfo:
    """Queries chunked, keys and values invariant. With the tokens on a batch axis (video
    frames folded into the batch), the keys of each item are cut to the chunk's items."""
    nd = len(node_shape(node))
    if iq.axis < nd - 2:
        for kv in keys:
            if node_shape(kv)[iq.axis] != 1:
                why = slice_operand(node, kv, iq.axis, iq)
                if why:
                    return unsupported(why)
    return iq

