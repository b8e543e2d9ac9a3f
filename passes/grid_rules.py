"""Token rules for ops over the token grid: the patchify convolution and its transpose
(unpatchify), an hourglass's pooling and nearest resampling, and unfold. A window that
tiles the rows (kernel == stride) maps a band of rows to a band of rows; one that
overlaps or skips them reaches across chunks and is refused with its reason (a 'same'
convolution is the exception: a halo read from a cache, `chunk_sums`). GRID_RULES, merged
with the others in `rules.py`."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import arg
from tokpipe_compiler.core.fx import node_shape
from tokpipe_compiler.core.meta import TOKEN, TOKEN_SUM, TokenInfo
from tokpipe_compiler.passes.rule_base import (
    Rule,
    RuleContext,
    first_token,
    mixes_tokens,
    registrar,
    source,
    unsupported,
)

GRID_RULES: dict[Any, Rule] = {}
register = registrar(GRID_RULES)

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
