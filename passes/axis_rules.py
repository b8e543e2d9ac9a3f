"""Token rules for ops that select, split, repeat, join or reduce along one axis: indexing
and writes, split/chunk, repeat/tile, cat/stack/pad_sequence, softmax, reductions.
AXIS_RULES, merged in `rules.py`."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import arg, varargs
from tokpipe_compiler.core.fx import example_value, node_shape, target_name
from tokpipe_compiler.core.meta import TokenInfo
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes import segments
from tokpipe_compiler.passes.rule_base import (
    Rule,
    RuleContext,
    first_token,
    mixes_tokens,
    registrar,
    slice_operand,
    source,
    summed,
    unsupported,
)
from tokpipe_compiler.passes.shape_rules import expand_index, getitem_axis, item_range
from tokpipe_compiler.runtime import branch_exchange  # noqa: F401  (defines tokpipe::cfg_gather)

AXIS_RULES: dict[Any, Rule] = {}
register = registrar(AXIS_RULES)

# Ops that write into their first argument and return nothing: their rule checks the write
# keeps the token layout; later readers of the argument see the written value.
IN_PLACE = {operator.setitem}

# -- indexing ----------------------------------------------------------------------------------


@register(operator.setitem)
def setitem(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    target, index, value = source(node), arg(node, 1, "index"), arg(node, 2, "value")
    info = ctx.info(target)
    if info is None or not info.carries_tokens:
        return unsupported("a token value is written into a tensor without tokens")
    shape = node_shape(target)
    items = expand_index(index, len(shape))
    moved = getitem_axis(items, info.axis, shape)
    if isinstance(moved, str):
        return unsupported(moved)
    part = info
    if moved[1] is not None and not isinstance(items[moved[1]], slice):
        return unsupported(f"a write into the token axis at index {items[moved[1]]} (write "
                           "a slice of it instead)")
    if moved[1] is not None:  # a write into the image tokens after a text segment, say
        start, stop, _ = items[moved[1]].indices(shape[info.axis])
        part = segments.cut(info, shape[info.axis], start, stop)
        if isinstance(part, str):
            return unsupported(part)
    written = ctx.info(value)
    if written is not None and written.carries_tokens and (
            written.per_unit, written.lead, written.trail) != (
            part.per_unit, part.lead, part.trail):
        return unsupported("a write of values with another token layout")
    return info


@register(operator.getitem)
def getitem(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("a token tensor is used as an index")
    index = arg(node, 1, "index")
    if not isinstance(example_value(src), torch.Tensor):
        return _tuple_element(src, info, index)
    shape = node_shape(src)
    items = expand_index(index, len(shape))
    moved = getitem_axis(items, info.axis, shape)
    if isinstance(moved, str):
        return unsupported(moved)
    axis, position = moved
    if position is None:
        return info.moved(axis)
    start, stop = item_range(items[position], shape[info.axis])
    piece = segments.cut(info, shape[info.axis], start, stop)
    if isinstance(items[position], slice) or info.outer > 1:
        return unsupported(piece) if isinstance(piece, str) else piece.moved(axis)
    if isinstance(piece, str) or piece.per_unit:
        lo, hi = info.lead, shape[info.axis] - info.trail
        return unsupported(
            f"indexing the token axis with {items[position]}: token {start} is one of the "
            f"chunked tokens [{lo}, {hi}), of which a chunk holds only its own; only tokens "
            "joined whole before or after them (a class token) can be taken by position")
    # One token of a segment, its axis dropped: a value every chunk holds whole.
    value = example_value(node)
    return segments.whole(value) if value.dim() else unsupported(
        "indexing a token tensor down to a scalar")


def _tuple_element(src: torch.fx.Node, info: TokenInfo, index: int) -> TokenInfo:
    """An element of a tuple from chunk/split: the source's layout, or its piece of a split
    along the token axis."""
    pieces = split_pieces(src, info)
    return pieces[index] if isinstance(pieces, list) else info


# -- split and chunk ---------------------------------------------------------------------------

# The keyword of each split's sizes argument.
_SPLITS = {"method:split": "split_size", torch.split: "split_size_or_sections",
           "method:split_with_sizes": "split_sizes", torch.split_with_sizes: "split_sizes"}


def split_pieces(node: torch.fx.Node, info: TokenInfo) -> list[TokenInfo] | None:
    """Per-piece TokenInfos of a split by sizes along the token axis (None for other ops)."""
    if op_key(node) not in _SPLITS:
        return None
    src = source(node)
    dim = arg(node, 2, "dim", 0) % len(node_shape(src))
    sizes = arg(node, 1, _SPLITS[op_key(node)])
    if dim != info.axis or not isinstance(sizes, (list, tuple)):
        return None
    pieces = segments.cut_sizes(info, node_shape(src)[dim], sizes)
    return pieces if isinstance(pieces, list) else None


@register("method:chunk", torch.chunk, "method:split", torch.split, "method:split_with_sizes",
          torch.split_with_sizes)
def split_op(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dim = arg(node, 2, "dim", 0) % len(node_shape(src))
    if dim == info.axis and split_pieces(node, info) is None:
        return unsupported(f"{target_name(node)} along the token axis cuts through the chunks "
                           "(only a split by sizes at the text/image boundary is followed)")
    return info


@register(F.glu, torch._C._nn.glu)
def glu(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """A gated linear unit halves its `dim`: token-wise along any other axis."""
    src, info = first_token(node, ctx)
    if arg(node, 1, "dim", -1) % len(node_shape(src)) == info.axis:
        return unsupported("glu along the token axis pairs rows of the two halves of the "
                           "sequence, which a chunk does not hold")
    return info


@register("method:unbind", torch.unbind)
def unbind(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dim = arg(node, 1, "dim", 0) % len(node_shape(src))
    if dim == info.axis:
        return unsupported("unbind along the token axis")
    return info.moved(info.axis - (dim < info.axis))


@register("method:narrow", torch.narrow, "method:index_select", torch.index_select)
def select_along(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """narrow and index_select along an axis other than the tokens' (a feature range, some
    heads): each token's row keeps its own values, so each chunk takes its rows' part."""
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported(f"{target_name(node)} with indices computed from the tokens")
    if arg(node, 1, "dim") % len(node_shape(src)) == info.axis:
        return unsupported(f"{target_name(node)} along the token axis takes rows of the whole "
                           "sequence, which a chunk does not hold")
    return info


@register("method:movedim", torch.movedim, "method:moveaxis", torch.moveaxis)
def movedim(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    ndim = len(node_shape(src))
    moved = [arg(node, i, name) for i, name in ((1, "source"), (2, "destination"))]
    sources, destinations = ([d % ndim for d in (m if isinstance(m, (tuple, list)) else [m])]
                             for m in moved)
    order: list[int | None] = [None] * ndim  # output axis -> input axis
    for a, b in zip(sources, destinations, strict=True):
        order[b] = a
    rest = iter(a for a in range(ndim) if a not in sources)
    order = [a if a is not None else next(rest) for a in order]
    return info.moved(order.index(info.axis))


@register("method:repeat_interleave", torch.repeat_interleave)
def repeat_interleave(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
    if src is not source(node) or not isinstance(repeats, int) or dim is None:
        return unsupported("repeat_interleave with tensor repeats or without a dim")
    if dim % len(node_shape(src)) != info.axis:
        return info
    # Each token repeated in place: a chunk's rows stay one contiguous, longer range.
    return replace(info, per_unit=info.per_unit * repeats, lead=info.lead * repeats,
                   trail=info.trail * repeats)


# The keyword of each tiling's sizes argument.
_TILES = {"method:repeat": "repeats", "method:tile": "dims", torch.tile: "dims"}


@register(*_TILES)
def repeat(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """x.repeat(*sizes) and tile: the token axis is kept where its factor is 1 (the K/V
    heads of grouped-query attention are repeated, even by 1, on another axis)."""
    src, info = first_token(node, ctx)
    sizes = varargs(node, 1) or arg(node, 1, _TILES[op_key(node)])
    if src is not source(node) or not isinstance(sizes, (tuple, list)) or not all(
            isinstance(s, int) for s in sizes):
        return unsupported(f"{target_name(node)} with sizes computed in the graph")
    # Sizes align with the trailing dims: fewer than the dims (tile) leave the leading ones
    # alone, more add leading dims.
    ndim = len(node_shape(src))
    out_ndim = max(ndim, len(sizes))
    sizes = (1,) * (out_ndim - len(sizes)) + tuple(sizes)
    axis = info.axis + out_ndim - ndim
    if sizes[axis] != 1:
        return unsupported(f"{target_name(node)} x{sizes[axis]} along the token axis copies the "
                           "whole sequence after itself (a chunk's rows would not be one range)")
    return info.moved(axis)


# -- along one dim: softmax, cumsum, reductions ------------------------------------------------


@register("method:softmax", F.softmax, torch.softmax, "method:log_softmax", F.log_softmax,
          "method:cumsum", torch.cumsum)
def along_dim(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    default = -1 if "softmax" in str(node.target) else None
    dim = arg(node, 1, "dim", default)
    if dim is None or dim % len(node_shape(src)) == info.axis:
        return unsupported(f"{target_name(node)} along the token axis mixes tokens")
    return info


@register(F.normalize)
def normalize(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """`F.normalize(x, p, dim=1)`: each vector along `dim` to unit norm (QK-norm, cosine
    attention over the features): token-wise unless `dim` is the token axis."""
    src, info = first_token(node, ctx)
    if arg(node, 2, "dim", 1) % len(node_shape(src)) == info.axis:
        return unsupported("normalize along the token axis mixes tokens")
    return info


_REDUCTIONS = ["sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp", "prod"]
# Where a reduction's dim and keepdim sit when passed by position, where not (1 and 2): a
# norm's order comes first (`x.norm(2, -1)`), var's and std's `unbiased` before keepdim.
_DIM_AT = {"norm": 2, "linalg_norm": 2, "linalg_vector_norm": 2}
_KEEPDIM_AT = {"norm": 3, "linalg_norm": 3, "linalg_vector_norm": 3, "var": 3, "std": 3}


@register(*(f"method:{m}" for m in _REDUCTIONS), torch.sum, torch.mean, torch.amax, torch.amin,
          torch.var, torch.std, torch.logsumexp, torch.norm, torch.linalg.norm,
          torch.linalg.vector_norm)
@mixes_tokens
def reduction(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    ndim = len(node_shape(src))
    name = target_name(node).split(".")[-1]
    dims = arg(node, _DIM_AT.get(name, 1), "dim")
    if dims is None:
        return unsupported(f"{node.target} over all elements mixes tokens")
    dims = [d % ndim for d in (dims if isinstance(dims, (tuple, list)) else [dims])]
    if info.axis in dims:
        if name in ("sum", "mean"):
            return summed(node, info, target_name(node))
        return unsupported(f"{node.target} over the token axis mixes tokens (only sums and "
                           "means over tokens are kept as partial sums)")
    keepdim = arg(node, _KEEPDIM_AT.get(name, 2), "keepdim", False) is True
    shift = 0 if keepdim else sum(1 for d in dims if d < info.axis)
    return info.moved(info.axis - shift)


# -- joining -----------------------------------------------------------------------------------


@register(torch.cat, torch.concat, torch.concatenate)
def cat(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    rank = len(node_shape(node))
    # torch.cat skips 1-d empty tensors of any rank's joins (a K/V cache's first update)
    tensors = [t for t in arg(node, 0, "tensors") if rank == 1 or node_shape(t) != (0,)]
    dim = arg(node, 1, "dim", 0) % rank
    infos = [ctx.infos[t] for t in tensors if ctx.infos[t].carries_tokens]
    if len({i.axis for i in infos}) != 1:
        return unsupported("concatenated tensors carry tokens on different axes")
    if dim == infos[0].axis:
        pieces = [(ctx.info(t) if ctx.infos[t].carries_tokens else None, node_shape(t)[dim])
                  for t in tensors]
        joined = segments.joined(pieces)
        return unsupported(joined) if isinstance(joined, str) else joined
    if any(i != infos[0] for i in infos):
        return unsupported("concatenated tensors carry tokens with different layouts")
    for t in tensors:
        if not ctx.infos[t].carries_tokens and node_shape(t)[infos[0].axis] != 1:
            why = slice_operand(node, t, infos[0].axis, infos[0])
            if why:
                return unsupported(why)
    return infos[0].moved(infos[0].axis)


@register(torch.stack)
def stack(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    tensors = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", 0) % len(node_shape(node))
    infos = {ctx.infos[t] for t in tensors if ctx.infos[t].carries_tokens}
    if len(infos) != 1 or len(infos) != len({ctx.infos[t] for t in tensors}):
        return unsupported("stacks tensors that carry tokens differently (or not at all)")
    info = infos.pop()
    return info.moved(info.axis + (dim <= info.axis))


@register(torch._C._nn.pad_sequence, torch.nn.utils.rnn.pad_sequence)
def pad_sequence(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """Sequences [L_i, ...] padded to the longest along their first axis and stacked on a
    new batch axis (0 with batch_first, else 1): a stack where the lengths are equal."""
    sequences = arg(node, 0, "sequences")
    if not isinstance(sequences, (list, tuple)):
        return unsupported("pad_sequence of one tensor instead of a list of sequences")
    infos = {ctx.infos[s] for s in sequences}
    if len(infos) != 1:
        return unsupported("pad_sequence of sequences that carry tokens differently (or not "
                           "at all)")
    info = infos.pop()
    if info.axis == 0 and len({node_shape(s)[0] for s in sequences}) > 1:
        return unsupported("pad_sequence pads the token axis to the longest sequence")
    batch = 0 if arg(node, 1, "batch_first", False) else 1  # [B, L, ...] or [L, B, ...]
    return info.moved(info.axis + (batch <= info.axis))


@register(torch.ops.tokpipe.cfg_gather.default)
def cfg_gather(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """The guidance branches joined along the batch: the token layout is unchanged, unless
    the batch shares the token axis (then each branch's tokens would be interleaved)."""
    info = ctx.info(source(node))
    if info.axis == 0 or info.outer > 1:
        return unsupported("the guidance branches' exchange joins along the batch axis, which "
                           "here carries the tokens too")
    return info.moved(info.axis)
