"""The annotate pass's rule table: how each op moves the token axis.

A rule sees a node with at least one token-carrying input and returns the node's TokenInfo.
Supporting an op adds a rule here, not a branch in the pass. Nodes without token inputs are
INVARIANT and need no rule.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.graph_utils import example_value, node_shape
from tokpipe_compiler.tokens import ATTENTION, TOKEN, UNSUPPORTED, TokenInfo

from .shape_rules import getitem_axis, permute_axis, reshape_axis, transpose_axis

Rule = Callable[[torch.fx.Node, "RuleContext"], TokenInfo]
RULES: dict[Any, Rule] = {}

# Operands of these arguments are per-token constants to slice to the chunk (see slice_operand).
SLICES_KEY = "tokpipe_slices"


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


def slice_operand(node: torch.fx.Node, operand: torch.fx.Node, axis: int, per_unit: Any) -> None:
    """Record that an invariant operand is a per-token table (a positional embedding, say)
    that must be cut to the chunk before `node` uses it."""
    node.meta.setdefault(SLICES_KEY, []).append((operand, axis, per_unit))


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
    axis = per_unit = None
    for arg in ctx.token_args(node):
        info = ctx.infos[arg]
        at = info.axis + out_ndim - len(node_shape(arg))
        if axis is None:
            axis, per_unit = at, info.per_unit
        elif (at, info.per_unit) != (axis, per_unit):
            return unsupported("operands carry tokens on different axes")
    for arg in node.all_input_nodes:
        shape = node_shape(arg)
        if ctx.infos[arg].carries_tokens or shape is None:
            continue
        at = axis - (out_ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            slice_operand(node, arg, at, per_unit)
    return TokenInfo(TOKEN, axis, per_unit)


# -- views and layout -------------------------------------------------------------------------


@register("method:view", "method:reshape", torch.reshape, "method:flatten", torch.flatten,
          "method:unflatten", torch.unflatten, "method:squeeze", torch.squeeze,
          "method:unsqueeze", torch.unsqueeze, "method:view_as", "method:reshape_as")
def reshape(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("the token tensor gives the target shape of a reshape")
    moved = reshape_axis(node_shape(src), node_shape(node), info.axis, info.per_unit)
    if isinstance(moved, str):
        return unsupported(moved)
    return TokenInfo(TOKEN, *moved)


@register("method:permute", torch.permute)
def permute(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dims = node.args[1:] if node.op == "call_method" else node.args[1]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    return TokenInfo(TOKEN, permute_axis(info.axis, dims, len(node_shape(src))), info.per_unit)


@register("method:transpose", torch.transpose, "method:swapaxes", torch.swapaxes)
def transpose(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    d0, d1 = node.args[1], node.args[2]
    return TokenInfo(TOKEN, transpose_axis(info.axis, d0, d1, len(node_shape(src))), info.per_unit)


@register("method:expand", "method:expand_as")
def expand(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("the token tensor gives the target shape of an expand")
    shift = len(node_shape(node)) - len(node_shape(src))
    return TokenInfo(TOKEN, info.axis + shift, info.per_unit)


@register(operator.getitem)
def getitem(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("a token tensor is used as an index")
    if not isinstance(example_value(src), torch.Tensor):
        return info  # an element of a tuple from chunk/split: same layout as its source
    moved = getitem_axis(node.args[1], info.axis, node_shape(src))
    if isinstance(moved, str):
        return unsupported(moved)
    return TokenInfo(TOKEN, moved, info.per_unit)


# -- ops that work along one dim ---------------------------------------------------------------


def _dim_arg(node: torch.fx.Node, position: int, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get("dim", default)


@register("method:chunk", torch.chunk, "method:split", torch.split, "method:softmax",
          F.softmax, torch.softmax, "method:log_softmax", F.log_softmax, "method:cumsum")
def along_dim(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    default = -1 if "softmax" in str(node.target) else 0
    dim = _dim_arg(node, 2, default)
    if dim is None or dim % len(node_shape(src)) == info.axis:
        return unsupported(f"{node.target} along the token axis mixes tokens")
    return info


@register("method:unbind", torch.unbind)
def unbind(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dim = _dim_arg(node, 1, 0) % len(node_shape(src))
    if dim == info.axis:
        return unsupported("unbind along the token axis")
    return TokenInfo(TOKEN, info.axis - (dim < info.axis), info.per_unit)


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
        return unsupported(f"{node.target} over the token axis mixes tokens")
    keepdim = node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2] is True)
    shift = 0 if keepdim else sum(1 for d in dims if d < info.axis)
    return TokenInfo(TOKEN, info.axis - shift, info.per_unit)


@register(torch.cat, torch.concat, torch.concatenate)
def cat(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    tensors = node.args[0]
    ndim = len(node_shape(node))
    dim = _dim_arg(node, 1, 0) % ndim
    infos = [ctx.infos[t] for t in tensors if ctx.infos[t].carries_tokens]
    axis, per_unit = infos[0].axis, infos[0].per_unit
    if any((i.axis, i.per_unit) != (axis, per_unit) for i in infos):
        return unsupported("concatenated tensors carry tokens on different axes")
    if dim == axis:
        return unsupported("concatenation along the token axis (e.g. joint text+image tokens)")
    for t in tensors:
        if not ctx.infos[t].carries_tokens and node_shape(t)[axis] != 1:
            slice_operand(node, t, axis, per_unit)
    return TokenInfo(TOKEN, axis, per_unit)


# -- contractions ------------------------------------------------------------------------------


@register(F.linear, torch._C._nn.linear)
def linear(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("a linear layer's weight depends on the tokens")
    if info.axis == len(node_shape(src)) - 1:
        return unsupported("a linear layer contracts over the token axis")
    return info


@register(operator.matmul, torch.matmul, "method:matmul", torch.bmm, "method:bmm")
def matmul(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    a, b = node.args[0], node.args[1]
    ia, ib = ctx.info(a), ctx.info(b)
    out_ndim = len(node_shape(node))
    hint = "write attention with F.scaled_dot_product_attention so tokpipe can chunk it"
    if ib is not None and ib.carries_tokens:
        nb = len(node_shape(b))
        if ib.axis == nb - 2 or (ia is not None and ia.carries_tokens):
            return unsupported(f"matmul contracts over the token axis (mixes tokens); {hint}")
        if ib.axis == nb - 1:
            return TokenInfo(TOKEN, out_ndim - 1, ib.per_unit)
        return TokenInfo(TOKEN, ib.axis + out_ndim - nb, ib.per_unit)
    na = len(node_shape(a))
    if ia.axis == na - 1:
        return unsupported(f"matmul contracts over the token axis (mixes tokens); {hint}")
    return TokenInfo(TOKEN, ia.axis + out_ndim - na, ia.per_unit)


@register(torch.einsum, torch.functional.einsum)
def einsum(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    equation = node.args[0].replace(" ", "")
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if "..." in equation or "->" not in equation:
        return unsupported("einsum with an implicit output or ellipsis")
    inputs, output = equation.split("->")
    letters = inputs.split(",")
    token_letter = per_unit = None
    for spec, arg in zip(letters, operands, strict=True):
        info = ctx.info(arg)
        if info is not None and info.carries_tokens:
            letter = spec[info.axis]
            if token_letter not in (None, letter):
                return unsupported("einsum operands carry tokens on different letters")
            token_letter, per_unit = letter, info.per_unit
    if token_letter not in output:
        return unsupported(f"einsum sums over the token index '{token_letter}'")
    return TokenInfo(TOKEN, output.index(token_letter), per_unit)


# -- normalisation -----------------------------------------------------------------------------


@register(F.layer_norm, torch.layer_norm, F.rms_norm, torch.rms_norm)
def layer_norm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("a norm's weight depends on the tokens")
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    if info.axis >= len(node_shape(src)) - len(normalized):
        return unsupported("the norm normalises over the token axis")
    return info


@register(F.group_norm, torch.group_norm, F.instance_norm, F.batch_norm)
def group_norm(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    return unsupported(f"{node.target.__name__} normalises over all positions (mixes tokens)")


# -- convolution (patch embedding) -------------------------------------------------------------


@register(torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d)
def conv(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("a convolution's weight depends on the tokens")
    spatial = info.axis - 2
    if spatial < 0:
        return unsupported("convolution over the token axis as channels")
    weight = node_shape(node.args[1])
    kernel = weight[2 + spatial]
    stride, padding, dilation = (_conv_param(node, i, name, len(weight) - 2)[spatial]
                                 for i, name in ((3, "stride"), (4, "padding"), (5, "dilation")))
    if kernel != stride or padding != 0 or dilation != 1:
        return unsupported(
            f"convolution with kernel {kernel}, stride {stride}, padding {padding} along the "
            "token axis reaches across chunk rows (only patchify convolutions, kernel == "
            "stride, padding 0, can be chunked)"
        )
    return TokenInfo(TOKEN, info.axis, info.per_unit / stride)


def _conv_param(node: torch.fx.Node, position: int, name: str, dims: int) -> list[int]:
    default = 0 if name == "padding" else 1
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
    if isinstance(value, str):
        return [-1] * dims  # 'same'/'valid' padding strings: treat as unsupported padding
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


# -- embeddings and attention ------------------------------------------------------------------


@register(F.embedding, torch.embedding)
def embedding(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not node.args[0]:
        return unsupported("an embedding table depends on the tokens")
    return info


@register(F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
def attention(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    q, k, v = node.args[:3]
    iq, ik, iv = ctx.info(q), ctx.info(k), ctx.info(v)
    nd = len(node_shape(q))
    if not (ik.carries_tokens or iv.carries_tokens):
        return TokenInfo(TOKEN, iq.axis, iq.per_unit)  # cross-attention: keys are invariant
    if not (iq.carries_tokens and ik.carries_tokens and iv.carries_tokens):
        return unsupported("self-attention whose queries, keys and values differ in token use")
    if {iq.axis, ik.axis, iv.axis} != {nd - 2}:
        return unsupported("attention whose sequence axis is not the token axis")
    if len({iq.per_unit, ik.per_unit, iv.per_unit}) != 1:
        return unsupported("queries and keys of different token granularity")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        if ctx.info(mask).carries_tokens:
            return unsupported("an attention mask computed from the tokens")
        shape = node_shape(mask)
        if len(shape) >= 2 and shape[-2] != 1:
            slice_operand(node, mask, len(shape) - 2, iq.per_unit)
    return TokenInfo(ATTENTION, nd - 2, iq.per_unit)


def scaled_per_unit(info: TokenInfo, scale: int) -> TokenInfo:
    """The same info with per_unit multiplied by the grid scale (Fraction -> int)."""
    if not info.carries_tokens:
        return info
    value = Fraction(info.per_unit) * scale
    return TokenInfo(info.kind, info.axis, int(value), info.reason)
