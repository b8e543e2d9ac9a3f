"""The convolution op that chunk_sums emits for a convolution across token rows.

A "same" convolution along the token axis (kernel 2p + 1, stride 1, padding p: Sana's 3x3
depthwise convolution in its feed-forward) reads p rows on either side of a chunk. Its
input is kept whole in a cache, one slot per grid unit, like K/V: a chunk writes its own
rows, then convolves them with a halo read from the cache: the rows before it hold this
step's values (earlier chunks ran first), the rows after it the previous step's (stale
mode), as DistriFusion keeps the halos of its convolutions. Rows never written this
generation hold zeros. A chunk that is the whole sequence (sync mode, warmup steps)
convolves exactly as eager does and fills the cache on the way.

cache layout: [units of the whole sequence, *x's shape with the token axis per_unit long].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokpipe_compiler.runtime.kv_attention import CHUNK_START, CHUNK_UNITS
from tokpipe_compiler.runtime.op_library import define_op
from tokpipe_compiler.runtime.token_sums import write_units

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              cache: torch.Tensor, chunk: torch.Tensor, axis: int, per_unit: int,
              padding: list[int], groups: int) -> torch.Tensor:
    """convNd(x, weight, bias, stride 1, `padding`, groups) as over the whole sequence;
    `axis` is the token axis of x (a spatial axis, padded by padding[axis - 2])."""
    conv = _CONV[x.dim() - 2]
    if write_units(cache, chunk, x.unflatten(axis, (-1, per_unit)).movedim(axis, 0)):
        return conv(x, weight, bias, 1, padding, 1, groups)
    halo = padding[axis - 2]
    start, units = int(chunk[CHUNK_START]), int(chunk[CHUNK_UNITS])
    reach = -(-halo // per_unit)  # units the halo touches on each side
    low, high = max(start - reach, 0), min(start + units + reach, cache.shape[0])
    window = cache[low:high].movedim(0, axis).flatten(axis, axis + 1).to(x.dtype)
    first = start * per_unit - halo - low * per_unit  # where the halo starts in the window
    last = (start + units) * per_unit + halo - low * per_unit
    size = window.shape[axis]
    window = window.narrow(axis, max(first, 0), min(last, size) - max(first, 0))
    pad = [0, 0] * (x.dim() - 1 - axis) + [max(-first, 0), max(last - size, 0)]
    window = F.pad(window, pad)  # zeros beyond the sequence, as the padding gives
    along = list(padding)
    along[axis - 2] = 0
    return conv(window, weight, bias, 1, along, 1, groups)


def _halo_conv_fake(x, weight, bias, cache, chunk, axis, per_unit, padding, groups):
    return _CONV[x.dim() - 2](x, weight, bias, 1, padding, 1, groups)


halo_conv = define_op("halo_conv", _halo_conv, _halo_conv_fake, mutates=("cache",))
