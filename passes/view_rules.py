"""Token rules for elementwise ops and for ops that only move elements around: views,
reshapes, permutations and transposes, pixel shuffles, padding. VIEW_RULES, merged with the
others in `rules.py`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from math import prod
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import arg, varargs
from tokpipe_compiler.core.fx import node_shape, target_name
from tokpipe_compiler.core.meta import INVARIANT_INFO, TOKEN, TokenInfo
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes.rule_base import (
    Rule,
    RuleContext,
    first_token,
    registrar,
    slice_operand,
    source,
    unsupported,
)
from tokpipe_compiler.passes.shape_rules import merge_groups, permute_axis, transpose_axis

VIEW_RULES: dict[Any, Rule] = {}
register = registrar(VIEW_RULES)

# -- elementwise (broadcasting) ---------------------------------------------------------------

_ELEMENTWISE = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.pow, operator.neg, operator.iadd, operator.imul,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.neg, torch.where,
    torch.exp, torch.log, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.sqrt,
    torch.rsqrt, torch.abs, torch.erf, torch.clamp, torch.square, torch.relu, torch.maximum,
    torch.minimum, torch.masked_fill, torch.lerp, torch.addcmul, torch.clip, torch.clamp_min,
    torch.clamp_max, torch.nan_to_num,
    F.gelu, F.silu, F.relu, F.mish, F.leaky_relu, F.softplus, F.dropout, F.hardswish,
    torch._C._nn.gelu, torch._C._nn.silu, torch.nn.functional.sigmoid, torch.nn.functional.tanh,
    # comparisons and masks (`torch.where(h > 0, h, 0.1 * h)`, a NaN guard)
    operator.gt, operator.ge, operator.lt, operator.le, operator.eq, operator.ne,
    operator.invert, operator.and_, operator.or_, operator.xor, operator.abs, operator.mod,
    operator.isub, operator.itruediv,
    torch.gt, torch.ge, torch.lt, torch.le, torch.eq, torch.ne, torch.logical_not,
    torch.logical_and, torch.logical_or, torch.logical_xor, torch.bitwise_not,
    torch.isnan, torch.isinf, torch.isfinite, torch.signbit,
    # more of the pointwise maths
    torch.sign, torch.sgn, torch.reciprocal, torch.log1p, torch.expm1, torch.log2,
    torch.log10, torch.exp2, torch.floor, torch.ceil, torch.round, torch.trunc, torch.frac,
    torch.tan, torch.atan, torch.atan2, torch.sinh, torch.cosh, torch.asinh, torch.remainder,
    torch.fmod, torch.hypot, torch.copysign, torch.float_power, torch.erfc, torch.sinc,
    torch.relu_, torch.sigmoid_, torch.tanh_,
    F.elu, F.selu, F.celu, F.hardtanh, F.relu6, F.hardsigmoid, F.logsigmoid, F.softsign,
    F.tanhshrink, F.threshold, torch._C._nn.hardtanh, torch._C._nn.elu,
]
_ELEMENTWISE_METHODS = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "sqrt", "rsqrt", "abs", "clamp", "square", "relu", "masked_fill", "to", "float", "half",
    "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "__add__",
    "__mul__", "__radd__", "__rmul__", "__sub__", "__rsub__", "__truediv__", "add_", "mul_",
    "clamp_", "erf", "lerp", "addcmul", "float_power", "sign",
    # float16 guards against overflow (Flux's and Sana's blocks clip in float16)
    "clip", "clip_", "clamp_min", "clamp_max", "nan_to_num",
    "gt", "ge", "lt", "le", "eq", "ne", "logical_not", "logical_and", "logical_or",
    "bitwise_not", "isnan", "isinf", "isfinite", "bool", "int", "long", "where", "maximum",
    "minimum", "reciprocal", "log1p", "expm1", "log2", "exp2", "floor", "ceil", "round",
    "trunc", "frac", "tan", "atan", "remainder", "fmod", "sgn", "erfc",
    "sub_", "div_", "neg_", "exp_", "pow_", "abs_", "sqrt_", "rsqrt_", "tanh_", "sigmoid_",
    "relu_", "masked_fill_", "addcmul_", "lerp_", "nan_to_num_", "reciprocal_", "sign_",
    "floor_", "round_", "clamp_min_", "clamp_max_",
]


@register(*_ELEMENTWISE, *(f"method:{m}" for m in _ELEMENTWISE_METHODS))
def elementwise(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    out_ndim = len(node_shape(node))
    out = None
    for operand in _meeting_tokens(node, ctx, out_ndim):
        info = ctx.infos[operand]
        at = info.moved(info.axis + out_ndim - len(node_shape(operand)))
        if out is None:
            out = at
        elif at != out:
            return unsupported("operands carry tokens on different axes or segments")
    for operand in node.all_input_nodes:
        shape = node_shape(operand)
        if ctx.infos[operand].carries_tokens or shape is None:
            continue
        at = out.axis - (out_ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            why = slice_operand(node, operand, at, out)
            if why:
                return unsupported(why)
    return out


def _meeting_tokens(node: torch.fx.Node, ctx: RuleContext, out_ndim: int) -> list[torch.fx.Node]:
    """The token operands whose layouts must agree. A per-chunk value with no chunked range
    (a sum over tokens) that broadcasts along a chunked operand's token axis acts on it
    like a constant."""
    operands = ctx.token_args(node)
    chunked = [o for o in operands if ctx.infos[o].per_unit]
    if not chunked:
        return operands
    info = ctx.infos[chunked[0]]
    axis = info.axis + out_ndim - len(node_shape(chunked[0]))

    def broadcasts(operand: torch.fx.Node) -> bool:
        shape = node_shape(operand)
        at = axis - (out_ndim - len(shape))
        return at < 0 or shape[at] == 1

    return [o for o in operands if ctx.infos[o].per_unit or not broadcasts(o)]


@register(torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
          torch.randn_like, torch.rand_like, "method:new_empty", "method:new_zeros",
          "method:new_ones", "method:new_full")
def like(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    same_shape = node_shape(node) == node_shape(src)
    if node.op == "call_method" and src is source(node) and not same_shape:
        return INVARIANT_INFO  # x.new_ones(size): only x's dtype and device are used
    if src is not source(node) or not same_shape:
        return unsupported("a token tensor gives the shape of a new tensor")
    return info


# -- views and layout -------------------------------------------------------------------------


@register("method:view", "method:reshape", torch.reshape, "method:flatten", torch.flatten,
          "method:unflatten", torch.unflatten, "method:squeeze", torch.squeeze,
          "method:unsqueeze", torch.unsqueeze, "method:view_as", "method:reshape_as")
def reshape(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("the token tensor gives the target shape of a reshape")
    moved = reshape_layout(node_shape(src), node_shape(node), info)
    return unsupported(moved) if isinstance(moved, str) else moved


def reshape_layout(in_shape: Sequence[int], out_shape: Sequence[int],
                   info: TokenInfo) -> TokenInfo | str:
    """The token layout after a reshape, or why it cannot be followed.

    The dims merged with the token axis (its group) are seen flat: `blocks` outer blocks
    (the info's own times the group's dims before the token axis), each holding one copy
    of the token layout. The output axis is the one whose group dims before it consume as
    many of those blocks as divide evenly: [B, F, C] (tokens F) -> [B * F, C] has outer B,
    and [B * F, C] (outer B) -> [B, F, C] gives the frames back with outer 1.
    """
    for in_dims, out_dims in merge_groups(list(in_shape), list(out_shape)):
        if info.axis in in_dims:
            return _regrouped(in_shape, out_shape, in_dims, out_dims, info)
    return "shapes do not match"


def _regrouped(in_shape: Sequence[int], out_shape: Sequence[int], in_dims: list[int],
               out_dims: list[int], info: TokenInfo) -> TokenInfo | str:
    axis = info.axis
    blocks = info.outer * prod(in_shape[d] for d in in_dims if d < axis)
    inner = prod(in_shape[d] for d in in_dims if d > axis)
    block = in_shape[axis] // info.outer * inner  # elements of one block, flat
    candidates = [j for j in out_dims if out_shape[j] != 1]
    if not candidates:
        return "the token axis collapses to size 1"
    for j in reversed(candidates):  # the most outer blocks consumed first
        before = prod(out_shape[d] for d in out_dims if d < j)
        after = prod(out_shape[d] for d in out_dims if d > j)
        if blocks % before or (blocks > before and block % after):
            continue  # blocks would straddle rows of axis j
        ratio = Fraction(inner, after)
        lead, trail = info.lead * ratio, info.trail * ratio
        if lead.denominator != 1 or trail.denominator != 1:
            return "a reshape splits the text segment of the token axis"
        return replace(info, kind=TOKEN, axis=j, per_unit=info.per_unit * ratio,
                       lead=int(lead), trail=int(trail), outer=blocks // before)
    return ("the token axis is an inner factor of a merged axis whose rows straddle the "
            "token blocks (chunks would not be whole rows)")


@register(torch.view_as_complex, torch.view_as_real)
def complex_view(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    if info.axis == len(node_shape(src)) - 1:
        return unsupported("a complex view over the token axis")
    return info


@register(F.pad, torch._C._nn.pad)
def pad(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    widths = arg(node, 1, "pad")
    from_last = len(node_shape(src)) - 1 - info.axis
    if src is not source(node) or any(widths[2 * from_last : 2 * from_last + 2]):
        return unsupported("padding along the token axis")
    return info


@register("method:permute", torch.permute)
def permute(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    dims = varargs(node, 1) or arg(node, 1, "dims")  # x.permute(*dims), torch.permute(x, dims)
    return info.moved(permute_axis(info.axis, dims, len(node_shape(src))))


_TRANSPOSES = {"method:transpose", torch.transpose, "method:swapaxes", torch.swapaxes}
# Attributes that transpose (Dynamo records `k.mT` as getattr(k, "mT")): the last two axes,
# conjugated for mH and H (elementwise); T and H only of a matrix (of more axes, T reverses
# them all, which PyTorch deprecates).
_TRANSPOSE_ATTRIBUTES = {"mT": None, "mH": None, "T": 2, "H": 2}


def swapped_axes(node: torch.fx.Node) -> tuple[int, int] | None:
    """The two axes a transpose (op or attribute) swaps; None for any other node."""
    if op_key(node) in _TRANSPOSES:
        return arg(node, 1, "dim0"), arg(node, 2, "dim1")
    shape = node_shape(node.args[0]) if op_key(node) is getattr else None
    if shape is None or node.args[1] not in _TRANSPOSE_ATTRIBUTES:
        return None
    return (-2, -1) if _TRANSPOSE_ATTRIBUTES[node.args[1]] in (None, len(shape)) else None


@register(*_TRANSPOSES, getattr)
def transpose(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    swapped = swapped_axes(node)
    if swapped is None:
        return unsupported(f"no token rule for the tensor attribute '.{node.args[1]}' "
                           "(followed: .mT, .mH, and .T and .H of a 2-d tensor)")
    return info.moved(transpose_axis(info.axis, *swapped, len(node_shape(src))))


@register(F.pixel_shuffle, F.pixel_unshuffle)
def pixel_shuffle(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """[..., C * r * r, H, W] -> [..., C, H * r, W * r], an unpatchify: each input row (or
    column) becomes r of its own, as with the unpatchify reshape. pixel_unshuffle, its
    inverse, a patchify: each band of r rows becomes one."""
    src, info = first_token(node, ctx)
    shape, shuffle = node_shape(src), node.target is F.pixel_shuffle
    factor = arg(node, 1, "upscale_factor" if shuffle else "downscale_factor")
    ratio = Fraction(factor) if shuffle else Fraction(1, factor)
    if info.axis < len(shape) - 3:
        return info  # the token axis is a batch axis
    if info.axis == len(shape) - 3:
        return unsupported(f"{target_name(node)} of a token axis as channels moves its "
                           "elements across chunks (chunked: tokens along the rows or columns)")
    sizes = (info.lead, info.trail, shape[info.axis] // info.outer)
    if any((size * ratio).denominator != 1 for size in sizes):
        return unsupported(f"{target_name(node)} takes bands of rows across the edge of a "
                           "whole segment (a class or text token) or of an outer block")
    return replace(info, per_unit=info.per_unit * ratio, lead=int(info.lead * ratio),
                   trail=int(info.trail * ratio))


@register("method:expand", "method:expand_as")
def expand(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    src, info = first_token(node, ctx)
    target = ctx.info(arg(node, 1, "other")) if op_key(node) == "method:expand_as" else None
    if not info.per_unit and target is not None and target.carries_tokens and target.per_unit:
        # a value with no chunked range (a mean over the tokens) spread over each of the
        # chunk's rows: a view shaped as the chunk's token tensor is
        return target
    if src is not source(node):
        return unsupported("the token tensor gives the target shape of an expand")
    axis = info.axis + len(node_shape(node)) - len(node_shape(src))
    if node_shape(node)[axis] != node_shape(src)[info.axis]:
        # Every row would be a copy of the one row of a chunk: a repeat, not a view.
        return unsupported(f"{target_name(node)} broadcasts the token axis from size 1")
    return info.moved(axis)
