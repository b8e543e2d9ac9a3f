"""The partial-sum ops that chunk_sums emits for sums over the token axis.

A sum over tokens is kept as one partial sum per grid unit in a cache, like K/V: a chunk
writes the partials of its own units and reads the sum of every unit's. Units before and
in the chunk hold this step's partials, units after it the previous step's (stale mode),
as DistriFusion keeps GroupNorm statistics. Units never written this generation hold
zeros. A chunk that is the whole sequence (sync mode, warmup steps) computes the op
exactly as eager does and fills the cache on the way.

cache layout: [units of the whole sequence, *the partial's shape].
"""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F

from tokpipe_compiler.runtime.kv_attention import CHUNK_START, CHUNK_UNITS
from tokpipe_compiler.runtime.op_library import define_op


def _token_sum(x: torch.Tensor, cache: torch.Tensor, chunk: torch.Tensor, axis: int,
              per_unit: int, dims: list[int], keepdim: bool, mean: bool) -> torch.Tensor:
    """x.sum(dims) (or .mean) as over the whole sequence; `axis` (in `dims`) is the token
    axis of x, `per_unit` its elements per grid unit."""
    rest = [d for d in dims if d != axis]
    partial = x.sum(rest, keepdim=True) if rest else x
    partial = partial.unflatten(axis, (-1, per_unit)).sum(axis + 1).movedim(axis, 0)
    whole = write_units(cache, chunk, partial)
    if whole:
        return (x.mean if mean else x.sum)(dims, keepdim=keepdim)
    total = cache.sum(0).unsqueeze(axis)
    if mean:
        total = total / (prod(x.shape[d] for d in rest) * cache.shape[0] * per_unit)
    return (total if keepdim else total.squeeze(dims)).to(x.dtype)


def _token_sum_fake(x, cache, chunk, axis, per_unit, dims, keepdim, mean):
    return x.sum(dims, keepdim=keepdim)


token_sum = define_op("token_sum", _token_sum, _token_sum_fake, mutates=("cache",))


def _token_matmul(a: torch.Tensor, b: torch.Tensor, cache: torch.Tensor, chunk: torch.Tensor,
                 per_unit: int) -> torch.Tensor:
    """a @ b contracted over the token axis (a [..., M, n], b [..., n, K]), as over the
    whole sequence: linear attention's K^T V."""
    a_units = a.unflatten(-1, (-1, per_unit)).movedim(-2, -3)  # [..., u, M, p]
    b_units = b.unflatten(-2, (-1, per_unit))  # [..., u, p, K]
    partial = torch.matmul(a_units, b_units).movedim(-3, 0)
    if write_units(cache, chunk, partial.to(cache.dtype)):
        return torch.matmul(a, b)
    return cache.sum(0).to(torch.promote_types(a.dtype, b.dtype))


def _token_matmul_fake(a, b, cache, chunk, per_unit):
    return torch.matmul(a, b)


token_matmul = define_op("token_matmul", _token_matmul, _token_matmul_fake, mutates=("cache",))


def _token_group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, eps: float, cache: torch.Tensor,
                     chunk: torch.Tensor, axis: int, per_unit: int) -> torch.Tensor:
    """F.group_norm of x [B, C, ...] with statistics over the whole sequence (token axis
    `axis` >= 2); the cache holds per unit the sums of x and x * x of each group."""
    acc = torch.promote_types(x.dtype, torch.float32)
    grouped = x.movedim(axis, -1).reshape(x.shape[0], groups, -1, x.shape[axis]).to(acc)
    per = grouped.unflatten(-1, (-1, per_unit))  # [B, G, R, u, p]
    sums = torch.stack([per.sum((2, 4)), (per * per).sum((2, 4))])  # [2, B, G, u]
    if write_units(cache, chunk, sums.movedim(-1, 0)):
        return F.group_norm(x, groups, weight, bias, eps)
    total = cache.sum(0)  # [2, B, G]
    count = grouped.shape[2] * cache.shape[0] * per_unit
    mean = total[0] / count
    var = (total[1] / count - mean * mean).clamp_min(0)
    flat = x.reshape(x.shape[0], groups, -1).to(acc)
    out = ((flat - mean[..., None]) * torch.rsqrt(var + eps)[..., None]).reshape(x.shape)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.to(x.dtype)


def _token_group_norm_fake(x, groups, weight, bias, eps, cache, chunk, axis, per_unit):
    return torch.empty_like(x)


token_group_norm = define_op("token_group_norm", _token_group_norm, _token_group_norm_fake,
                             mutates=("cache",))


def write_units(cache: torch.Tensor, chunk: torch.Tensor, partial: torch.Tensor) -> bool:
    """Writes the chunk's per-unit partials into the cache; True when the chunk is the
    whole sequence (then the op computes its value exactly, not from the cache)."""
    start, units = int(chunk[CHUNK_START]), int(chunk[CHUNK_UNITS])
    cache[start : start + units].copy_(partial)
    return start == 0 and units == cache.shape[0]
