"""Token rules for ops that compute: contractions, norms, the patchify convolution (and its
transpose, unpatchify) and unfold, embeddings and attention. COMPUTE_RULES, merged with the
others in `rules.py`."""

from __future__ import annotations

import operator
from dataclasses import replace
from fractions import Fraction
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


# -- convolution (patch embedding) -------------------------------------------------------------


@register(torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d)
@mixes_tokens
def conv(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    found = _conv_token_axis(node, ctx)
    if isinstance(found, TokenInfo):
        return found
    info, spatial, weight = found
    kernel = weight[2 + spatial]
    stride, padding, dilation = (conv_param(node, i, name, len(weight) - 2)[spatial]
                                 for i, name in ((3, "stride"), (4, "padding"), (5, "dilation")))
    if kernel == stride and padding == 0 and dilation == 1:  # a patchify convolution
        return replace(info, kind=TOKEN, per_unit=info.per_unit / stride)
    same = stride == 1 and dilation == 1 and kernel == 2 * padding + 1
    if same and info.outer == 1 and info.per_unit > 0:
        # rows from either side of a chunk: a halo from a cache of the input (chunk_sums)
        return replace(info, kind=TOKEN_SUM)
    if same:
        return unsupported(
            f"a 'same' convolution (kernel {kernel}, padding {padding}) along a token axis "
            + ("that joins the grids of several batch rows or frames" if info.outer != 1
               else "that holds no chunked rows (text segments only)")
            + ": its halo rows cannot be cut from one grid")
    padding = "'same', uneven for this kernel" if padding == -1 else padding
    return unsupported(
        f"convolution with kernel {kernel}, stride {stride}, padding {padding}, dilation "
        f"{dilation} along the token axis reaches across chunk rows (chunked: patchify "
        "convolutions, kernel == stride, and 'same' ones, stride 1, kernel 2p+1 with padding "
        "p or padding='same')")


def _conv_token_axis(node: torch.fx.Node,
                     ctx: RuleContext) -> TokenInfo | tuple[TokenInfo, int, torch.Size]:
    """(the token input's info, its spatial axis, the weight's shape) of a convolution, or
    the convolution's TokenInfo where that is decided without its parameters."""
    src, info = first_token(node, ctx)
    if src is not source(node):
        return unsupported("a convolution's weight depends on the tokens")
    if info.axis == 0:
        return info  # the token axis is the batch (video frames folded into it)
    spatial = info.axis - 2
    if spatial < 0 or info.segmented:
        return unsupported("convolution over the token axis as channels")
    return info, spatial, node_shape(arg(node, 1, "weight"))


@register(torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d)
def conv_transpose(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """An unpatchify convolution (kernel == stride, no padding): each input row becomes
    `stride` output rows of its own, so a chunk's rows map to a band of output rows."""
    found = _conv_token_axis(node, ctx)
    if isinstance(found, TokenInfo):
        return found
    info, spatial, weight = found
    kernel = weight[2 + spatial]
    stride, padding, out_padding, dilation = (
        conv_param(node, i, name, len(weight) - 2)[spatial]
        for i, name in ((3, "stride"), (4, "padding"), (5, "output_padding"), (7, "dilation")))
    if kernel == stride and padding == 0 and out_padding == 0 and dilation == 1:
        return replace(info, kind=TOKEN, per_unit=info.per_unit * stride)
    return unsupported(
        f"transposed convolution with kernel {kernel}, stride {stride}, padding {padding} "
        "along the token axis reaches across chunk rows (chunked: kernel == stride)")


def conv_param(node: torch.fx.Node, position: int, name: str, dims: int) -> list[int]:
    default = 0 if name in ("padding", "output_padding") else 1
    value = arg(node, position, name, default)
    if value == "valid":
        return [0] * dims
    if value == "same":  # stride 1 (torch's rule): dilation * (kernel - 1) in all, per axis
        kernels = node_shape(arg(node, 1, "weight"))[2:]
        dilations = conv_param(node, 5, "dilation", dims)
        totals = [d * (k - 1) for d, k in zip(dilations, kernels, strict=True)]
        return [t // 2 if t % 2 == 0 else -1 for t in totals]  # -1: uneven, unsupported
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


# -- pooling and nearest resampling (an hourglass's token merge and split) ---------------------

# op -> (spatial dims, name)
_POOLS = {op: (int(name[-2]), name) for name in
          ("avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d")
          for op in [getattr(F, name)]}


@register(*_POOLS)
def pool(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """A pooling whose windows tile the token axis (kernel == stride, no padding, dilation
    1): each band of `stride` rows becomes one row, as with a patchify convolution."""
    src, info = first_token(node, ctx)
    dims, name = _POOLS[node.target]
    is_max = name.startswith("max")
    spatial = _resampled_axis(info, len(node_shape(src)), dims)
    if not isinstance(spatial, int):
        return spatial
    kernel = _per_dim(arg(node, 1, "kernel_size"), dims)[spatial]
    stride = _per_dim(arg(node, 2, "stride") or kernel, dims)[spatial]
    padding = _per_dim(arg(node, 3, "padding", 0), dims)[spatial]
    dilation = _per_dim(arg(node, 4, "dilation", 1), dims)[spatial] if is_max else 1
    if is_max and arg(node, 6, "return_indices", False):
        return unsupported(f"{name} returns indices into the whole grid")
    if kernel != stride or padding != 0 or dilation != 1:
        return unsupported(f"{name} with kernel {kernel}, stride {stride}, "
                           f"padding {padding} along the token axis reaches across chunk "
                           "rows (chunked: kernel == stride, no padding)")
    return _resampled(name, info, Fraction(1, kernel), node_shape(src))


@register(F.interpolate)
def interpolate(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """Nearest resampling by a whole factor along the token axis: each row becomes r rows
    (an upsample, as pixel_shuffle), or every r-th row is kept (a downsample)."""
    src, info = first_token(node, ctx)
    shape = node_shape(src)
    dims = len(shape) - 2
    spatial = _resampled_axis(info, len(shape), dims)
    if not isinstance(spatial, int):
        return spatial
    mode, scale = arg(node, 3, "mode", "nearest"), arg(node, 2, "scale_factor")
    if mode not in ("nearest", "nearest-exact"):
        return unsupported(f"interpolate(mode={mode!r}) blends neighbouring rows, across "
                           "chunk edges along the token axis (chunked: mode='nearest')")
    if scale is None:
        return unsupported("interpolate(size=...) along the token axis gives the whole "
                           "grid's size; pass scale_factor= to resample each chunk")
    factor = float(_per_dim(scale, dims)[spatial])
    ratio = Fraction(int(factor)) if factor >= 1 and factor.is_integer() else \
        Fraction(1, int(1 / factor)) if 0 < factor < 1 and (1 / factor).is_integer() else None
    if ratio is None:
        return unsupported(f"interpolate by {factor} along the token axis maps rows "
                           "across chunk edges (chunked: a whole factor or its inverse)")
    return _resampled("interpolate", info, ratio, shape)


def _resampled_axis(info: TokenInfo, rank: int, dims: int) -> TokenInfo | int:
    """The token axis among a pooling's or resampling's `dims` spatial axes, or the
    info to return where it is none of them (a batch axis: handed on; channels: refused)."""
    spatial = info.axis - (rank - dims)
    if spatial >= 0:
        return spatial if not info.segmented else unsupported(
            "pooling or resampling of a token axis that joins other segments (text) to "
            "the grid")
    if info.axis < rank - dims - 1:
        return info
    return unsupported("pooling or resampling over the token axis as channels")


def _resampled(name: str, info: TokenInfo, ratio: Fraction, shape: torch.Size) -> TokenInfo:
    """`info` with each unit's rows scaled by `ratio` (whole segments scaled alike)."""
    rows = shape[info.axis] // info.outer
    if (rows * ratio).denominator != 1:
        return unsupported(f"{name} by {ratio} along the token axis does not tile its "
                           f"{rows} rows (a window of {ratio.denominator} rows crosses "
                           "the grid's edge)")
    if any((size * ratio).denominator != 1 for size in (info.lead, info.trail)):
        return unsupported(f"{name} takes bands of rows across the edge of a whole "
                           "segment (a class or text token)")
    return replace(info, per_unit=info.per_unit * ratio, lead=int(info.lead * ratio),
                   trail=int(info.trail * ratio))


def _per_dim(value: Any, dims: int) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


# -- unfold (patch embedding) ------------------------------------------------------------------

_PATCHIFY = "chunked: kernel == stride, no padding, dilation 1; or patchify by view/reshape"


@register(F.unfold, torch._C._nn.im2col)
def unfold(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """F.unfold with kernel == stride along the token rows, a patchify: [B, C, H, W] ->
    [B, C*kh*kw, L], each band of kh rows the next run of L (its windows, left to right)."""
    src, info = first_token(node, ctx)
    shape = node_shape(src)
    rows = len(shape) - 2  # the spatial axes are the last two: rows, columns
    if info.axis < rows - 1:
        return info  # the token axis is the batch
    if info.axis != rows:
        axis = "channels" if info.axis < rows else "columns"
        return unsupported(f"F.unfold of a token axis as {axis} lays each window out over "
                           f"every chunk's tokens ({_PATCHIFY}, with the tokens along the "
                           "rows, dim -2)")
    if info.segmented:
        return unsupported("F.unfold of a token axis with whole text segments around its rows")
    kernel, dilation, padding, stride = (
        conv_param(node, i, name, 2)
        for i, name in enumerate(("kernel_size", "dilation", "padding", "stride"), 1))
    if (kernel[0], padding[0], dilation[0]) != (stride[0], 0, 1):
        return unsupported(
            f"F.unfold with kernel {kernel[0]}, stride {stride[0]}, padding {padding[0]}, "
            f"dilation {dilation[0]} along the token rows takes rows of neighbouring chunks "
            f"({_PATCHIFY})")
    columns = (shape[-1] + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    bands = Fraction(info.per_unit) / kernel[0]
    ctx.keep_bands(bands)  # the output's per_unit (bands * columns) would not show them
    return replace(info, kind=TOKEN, axis=rows, per_unit=bands * columns)


@register("method:unfold")
def windows(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    """x.unfold(dim, size, step): windows along `dim`, each one's elements on a new last
    axis. Along the token axis with size == step, a patchify: the token axis counts the
    windows, each inside one band of `size` rows."""
    src, info = first_token(node, ctx)
    if arg(node, 1, "dimension") % len(node_shape(src)) != info.axis:
        return info  # windows of another axis: the token axis keeps its place
    size, step = arg(node, 2, "size"), arg(node, 3, "step")
    if size != step:
        return unsupported(f"Tensor.unfold with size {size}, step {step} along the token axis "
                           f"takes rows of neighbouring chunks ({_PATCHIFY}: size == step)")
    if info.segmented:
        return unsupported("Tensor.unfold of a token axis with whole text segments around its "
                           "rows")
    return replace(info, kind=TOKEN, per_unit=Fraction(info.per_unit) / size)


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
    if not (iq.carries_tokens and ik.carries_tokens and iv.carries_tokens):
        return unsupported("self-attention whose queries, keys and values differ in token use")
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

