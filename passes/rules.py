"""The annotate pass's rule table: how each op moves the token axis.

A rule sees a node with at least one token-carrying input and returns the node's TokenInfo.
Supporting an op adds a rule here, not a branch in the pass. Nodes without token inputs are
INVARIANT and need no rule.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.fx import example_value, node_shape, target_name
from tokpipe_compiler.core.meta import INVARIANT_INFO, SLICES_KEY, TOKEN, UNSUPPORTED, TokenInfo
from tokpipe_compiler.passes import segments
from tokpipe_compiler.passes.shape_rules import (
    expand_index,
    getitem_axis,
    permute_axis,
    reshape_axis,
    transpose_axis,
)

Rule = Callable[[torch.fx.Node, "RuleContext"], TokenInfo]
RULES: dict[Any, Rule] = {}

# Operands of these arguments are per-token constants to slice to the chunk (see slice_operand).


class RuleContext:
    """What a rule may ask: the TokenInfo of any earlier node."""

    def __init__(self, infos: dict[torch.fx.Node, TokenInfo]):
        self.infos = infos

    def info(self, arg: Any) -> TokenInfo | None:
        return self.infos.get(arg) if isinstance(arg, torch.fx.Node) else None

    def token_args(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return [a for a in node.all_input_nodes if self.infos[a].carries_tokens]


def op_key(node: torch.fx.Node) -> Any:
    return f"method:{node.target}" if node.op == "call_method" else node.target


def register(*keys: Any) -> Callable[[Rule], Rule]:
    def wrap(rule: Rule) -> Rule:
        for key in keys:
            RULES[key] = rule
        return rule

    return wrap


def unsupported(reason: str) -> TokenInfo:
    return TokenInfo(UNSUPPORTED, reason=reason)


def first_token(node: torch.fx.Node, ctx: RuleContext) -> tuple[torch.fx.Node, TokenInfo]:
    arg = ctx.token_args(node)[0]
    return arg, ctx.infos[arg]


def slice_operand(node: torch.fx.Node, operand: torch.fx.Node, axis: int, info: TokenInfo) -> str:
    """Record that an invariant operand is a per-token table (a positional embedding, say)
    that must be cut to the chunk before `node` uses it; returns why it cannot be, or ''.
    `axis`: the operand's axis that lines up with the token axis of `info`, `node`'s own."""
    if not info.per_unit:
        return ""  # a segment-only value: every chunk uses the table whole
    table, full = node_shape(operand)[axis], node_shape(node)[info.axis]
    if table != full:
        return (f"a per-token table of {table} rows meets a token axis of {full} rows (a "
                "table longer than the sequence must be cut to it before the model uses it)")
    node.meta.setdefault(SLICES_KEY, []).append((operand, axis, info.moved(axis)))
    return ""


# -- elementwise (broadcasting) ---------------------------------------------------------------

_ELEMENTWISE = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.pow, operator.neg, operator.iadd, operator.imul,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.neg, torch.where,
    torch.exp, torch.log, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.sqrt,
    torch.rsqrt, torch.abs, torch.erf, torch.clamp, torch.square, torch.relu, torch.maximum,
    torch.minimum, torch.masked_fill, torch.lerp, torch.addcmul,
    F.gelu, F.silu, F.relu, F.mish, F.leaky_relu, F.softplus, F.dropout, F.hardswish,
    torch._C._nn.gelu, torch._C._nn.silu, torch.nn.functional.sigmoid, torch.nn.functional.tanh,
]
_ELEMENTWISE_METHODS = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "sqrt", "rsqrt", "abs", "clamp", "square", "relu", "masked_fill", "to", "float", "half",
    "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "__add__",
    "__mul__", "__radd__", "__rmul__", "__sub__", "__rsub__", "__truediv__", "add_", "mul_",
    "clamp_", "erf", "lerp", "addcmul", "float_power", "sign",
]


@register(*_ELEMENTWISE, *(f"method:{m}" for m in _ELEMENTWISE_METHODS))
def elementwise(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    out_ndim = len(node_shape(node))
    out = None
    for arg in ctx.token_args(node):
        info = ctx.infos[arg]
        at = info.moved(info.axis + out_ndim - len(node_shape(arg)))
        if out is None:
            out = at
        elif at != out:
            return unsupported("operands carry tokens on different axes or segments")
    for arg in node.all_input_nodes:
        shape = node_shape(arg)
        if ctx.infos[arg].carries_tokens or shape is None:
            continue
        at = out.axis - (out_ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            why = slice_operand(node, arg, at, out)
            if why:
                return unsupported(why)
    return out


@register(torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
          torch.randn_like, torch.rand_like, "method:new_empty", "method:new_zeros",
          "method:new_ones", "method:new_full")
def like(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if node.op == "call_method" and src is node.args[0] and node_shape(node) != node_shape(src):
        return INVARIANT_INFO  # x.new_ones(size): only x's dtype and device are used
    if src is not node.args[0] or node_shape(node) != node_shape(src):
        return unsupported("a token tensor gives the shape of a new tensor")
    return info


# Ops that write into their first argument and return nothing: their rule checks the write
# keeps the token layout; later readers of the argument see the written value.
IN_PLACE = {operator.setitem}


@register(operator.setitem)
def setitem(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    target, index, value = node.args
    info = ctx.info(target)
    if info is None or not info.carries_tokens:
        return unsupported("a token value is written into a tensor without tokens")
    shape = node_shape(target)
    items = expand_index(index, len(shape))
    moved = getitem_axis(items, info.axis, shape)
    if isinstance(moved, str):
        return unsupported(moved)
    part = info
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


# -- views and layout -------------------------------------------------------------------------


@register("method:view", "method:reshape", torch.reshape, "method:flatten", torch.flatten,
          "method:unflatten", torch.unflatten, "method:squeeze", torch.squeeze,
          "method:unsqueeze", torch.unsqueeze, "method:view_as", "method:reshape_as")
def reshape(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("the token tensor gives the target shape of a reshape")
    moved = reshape_axis(node_shape(src), node_shape(node), info.axis)
    if isinstance(moved, str):
        return unsupported(moved)
    axis, ratio = moved
    lead, trail = info.lead * ratio, info.trail * ratio
    if lead.denominator != 1 or trail.denominator != 1:
        return unsupported("a reshape splits the text segment of the token axis")
    return replace(info, kind=TOKEN, axis=axis, per_unit=info.per_unit * ratio,
                   lead=int(lead), trail=int(trail))


@register(torch.view_as_complex, torch.view_as_real)
def complex_view(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if info.axis == len(node_shape(src)) - 1:
        return unsupported("a complex view over the token axis")
    return info


@register(F.pad, torch._C._nn.pad)
def pad(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    widths = node.args[1] if len(node.args) > 1 else node.kwargs["pad"]
    from_last = len(node_shape(src)) - 1 - info.axis
    if src is not node.args[0] or any(widths[2 * from_last : 2 * from_last + 2]):
        return unsupported("padding along the token axis")
    return info


@register("method:permute", torch.permute)
def permute(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dims = node.args[1:] if node.op == "call_method" else node.args[1]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    return info.moved(permute_axis(info.axis, dims, len(node_shape(src))))


@register("method:transpose", torch.transpose, "method:swapaxes", torch.swapaxes)
def transpose(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    d0, d1 = node.args[1], node.args[2]
    return info.moved(transpose_axis(info.axis, d0, d1, len(node_shape(src))))


@register("method:expand", "method:expand_as")
def expand(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("the token tensor gives the target shape of an expand")
    shift = len(node_shape(node)) - len(node_shape(src))
    return info.moved(info.axis + shift)


@register(operator.getitem)
def getitem(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("a token tensor is used as an index")
    if not isinstance(example_value(src), torch.Tensor):
        return _tuple_element(src, info, node.args[1])
    shape = node_shape(src)
    moved = getitem_axis(expand_index(node.args[1], len(shape)), info.axis, shape)
    if isinstance(moved, str):
        return unsupported(moved)
    axis, position = moved
    if position is None:
        return info.moved(axis)
    start, stop, _ = expand_index(node.args[1], len(shape))[position].indices(shape[info.axis])
    piece = segments.cut(info, shape[info.axis], start, stop)
    return unsupported(piece) if isinstance(piece, str) else piece.moved(axis)


def _tuple_element(src: torch.fx.Node, info: TokenInfo, index: int) -> TokenInfo:
    """An element of a tuple from chunk/split: the source's layout, or its piece of a split
    along the token axis."""
    pieces = split_pieces(src, info)
    return pieces[index] if isinstance(pieces, list) else info


_SPLITS = {"method:split": "split_size", torch.split: "split_size_or_sections",
           "method:split_with_sizes": "split_sizes", torch.split_with_sizes: "split_sizes"}


def split_pieces(node: torch.fx.Node, info: TokenInfo) -> list[TokenInfo] | None:
    """Per-piece TokenInfos of a split by sizes along the token axis (None for other ops)."""
    if op_key(node) not in _SPLITS:
        return None
    src = node.args[0]
    dim = _dim_arg(node, 2, 0) % len(node_shape(src))
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs[_SPLITS[op_key(node)]]
    if dim != info.axis or not isinstance(sizes, (list, tuple)):
        return None
    pieces = segments.cut_sizes(info, node_shape(src)[dim], sizes)
    return pieces if isinstance(pieces, list) else None


# -- ops that work along one dim ---------------------------------------------------------------


def _dim_arg(node: torch.fx.Node, position: int, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get("dim", default)


@register("method:chunk", torch.chunk, "method:split", torch.split, "method:split_with_sizes",
          torch.split_with_sizes)
def split_op(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dim = _dim_arg(node, 2, 0) % len(node_shape(src))
    if dim == info.axis and split_pieces(node, info) is None:
        return unsupported(f"{target_name(node)} along the token axis cuts through the chunks "
                           "(only a split by sizes at the text/image boundary is followed)")
    return info


@register("method:softmax", F.softmax, torch.softmax, "method:log_softmax", F.log_softmax,
          "method:cumsum", torch.cumsum)
def along_dim(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    default = -1 if "softmax" in str(node.target) else None
    dim = _dim_arg(node, 1, default)
    if dim is None or dim % len(node_shape(src)) == info.axis:
        return unsupported(f"{target_name(node)} along the token axis mixes tokens")
    return info


@register("method:repeat_interleave", torch.repeat_interleave)
def repeat_interleave(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = _dim_arg(node, 2)
    if src is not node.args[0] or not isinstance(repeats, int) or dim is None:
        return unsupported("repeat_interleave with tensor repeats or without a dim")
    if dim % len(node_shape(src)) != info.axis:
        return info
    # Each token repeated in place: a chunk's rows stay one contiguous, longer range.
    return replace(info, per_unit=info.per_unit * repeats, lead=info.lead * repeats,
                   trail=info.trail * repeats)


@register("method:unbind", torch.unbind)
def unbind(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dim = _dim_arg(node, 1, 0) % len(node_shape(src))
    if dim == info.axis:
        return unsupported("unbind along the token axis")
    return info.moved(info.axis - (dim < info.axis))


_REDUCTIONS = ["sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp", "prod"]


@register(*(f"method:{m}" for m in _REDUCTIONS), torch.sum, torch.mean, torch.amax, torch.amin,
          torch.var, torch.std, torch.logsumexp)
def reduction(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    ndim = len(node_shape(src))
    dims = _dim_arg(node, 1)
    if dims is None:
        return unsupported(f"{node.target} over all elements mixes tokens")
    dims = [d % ndim for d in (dims if isinstance(dims, (tuple, list)) else [dims])]
    if info.axis in dims:
        return unsupported(f"{node.target} over the token axis mixes tokens (sums over tokens, "
                           "as in linear attention, are not chunked yet)")
    keepdim = node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2] is True)
    shift = 0 if keepdim else sum(1 for d in dims if d < info.axis)
    return info.moved(info.axis - shift)


@register(torch.cat, torch.concat, torch.concatenate)
def cat(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    tensors = node.args[0]
    ndim = len(node_shape(node))
    dim = _dim_arg(node, 1, 0) % ndim
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
    tensors = node.args[0]
    ndim = len(node_shape(node))
    dim = _dim_arg(node, 1, 0) % ndim
    infos = {ctx.infos[t] for t in tensors if ctx.infos[t].carries_tokens}
    if len(infos) != 1 or len(infos) != len({ctx.infos[t] for t in tensors}):
        return unsupported("stacks tensors that carry tokens differently (or not at all)")
    info = infos.pop()
    return info.moved(info.axis + (dim <= info.axis))


def scaled_per_unit(info: TokenInfo, scale: int) -> TokenInfo:
    """The same info with per_unit multiplied by the grid scale (Fraction -> int)."""
    if not info.carries_tokens:
        return info
    return replace(info, per_unit=int(Fraction(info.per_unit) * scale))


# Rules for ops that compute (contractions, norms, convolution, attention) live beside this
# module; importing it registers them.
from tokpipe_compiler.passes import compute_rules  # noqa: E402, F401
