"""Rates only a GPU has, measured on it: waves of GEMM tiles over its multiprocessors and
attention timed per score (what `DeviceRates.gemm_seconds` and `attention_by_score` use;
the H200 preset holds the same figures measured by benchmarks/gpu_rates.py).

    rates = refine(rates, "cuda:0", torch.bfloat16, time_fn)   # about a second
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from tokpipe_compiler.costmodel.calibrate import DeviceRates

# A product of many full waves on any GPU (2048 output tiles of 128 x 128): m, k, n.
WAVE_SHAPE = (8192, 4096, 4096)
# Attention over the same scores at two head dims: batch, heads, queries, keys.
SCORE_SHAPE = (1, 16, 2048, 4096)
HEAD_DIMS = (64, 128)
REPEATS = 10  # calls per timing: the host's wait for the device falls on ten of them

Timer = Callable[[Callable[[], object], str], float]


def refine(rates: DeviceRates, device: str, dtype: torch.dtype, time: Timer) -> DeviceRates:
    """`rates` of a CUDA `device` with its multiprocessors, the FLOP/s of full waves of GEMM
    tiles and attention per score; `time(fn, device)`: seconds of one call of fn."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    m, k, n = WAVE_SHAPE
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seconds = time(lambda: [a @ b for _ in range(REPEATS)], device) / REPEATS
    batch, heads, queries, keys = SCORE_SHAPE

    def attention_seconds(dim: int) -> float:
        q = torch.randn(batch, heads, queries, dim, device=device, dtype=dtype)
        kv = torch.randn(batch, heads, keys, dim, device=device, dtype=dtype)
        return time(lambda: [F.scaled_dot_product_attention(q, kv, kv)
                             for _ in range(REPEATS)], device) / REPEATS

    small, large = (attention_seconds(dim) for dim in HEAD_DIMS)
    waved = wave_rates(rates, sms, WAVE_SHAPE, seconds)
    return score_rates(waved, batch * heads * queries * keys, small, large)


def wave_rates(rates: DeviceRates, sms: int, shape: tuple[int, int, int],
               seconds: float) -> DeviceRates:
    """`rates` with `sms` multiprocessors at the full-wave FLOP/s that makes a product of
    `shape` (m, k, n) take `seconds` (gemm_seconds scales as 1 / matmul_flops)."""
    m, k, n = shape
    unit = replace(rates, sms=sms, matmul_flops=1.0)
    return replace(unit, matmul_flops=unit.gemm_seconds(m, n, k) / seconds)


def score_rates(rates: DeviceRates, scores: int, small: float, large: float) -> DeviceRates:
    """`rates` with attention per score, from the seconds of `scores` scores at heads of
    HEAD_DIMS[0] (`small`) and HEAD_DIMS[1] (`large`): the difference is the products over
    the extra head dims, the rest a time per score. `rates` unchanged where the two do not
    fit that (the larger heads not slower, or all the time in the products)."""
    low, high = HEAD_DIMS
    per_flop = (large - small) / (scores * 4 * (high - low))
    if per_flop <= 0:
        return rates
    score_seconds = small / scores - 4 * low * per_flop
    if score_seconds <= 0:
        return rates
    return replace(rates, attention_flops=1 / per_flop, score_seconds=score_seconds)
