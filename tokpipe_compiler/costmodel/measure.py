"""Measuring a device's rates (calibrate.measure_rates), robust to a busy machine.

On a CPU shared with other processes, an op split over several threads waits for its
slowest thread: with a core taken, one descheduled thread costs a scheduler tick, and a
streaming add of 12 MB at 2 threads on a 2-core machine fell from 150 GB/s to 1-3 GB/s for
seconds at a time (matmul rates varied 13x). So bandwidth is measured first, on warm
threads; each round's figures are checked (`problems`) against bounds no device leaves
and, at several threads, against one thread's (more threads never halve a rate on a
healthy machine); implausible rounds are measured again, keeping the best figure of each
kind, and figures that stay implausible raise CalibrationError.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.costmodel.calibrate import DeviceRates

ROUNDS = 3  # rounds of measuring, at most, until the figures are plausible
# Figures outside these no device this code runs on sustains: (low, high) per field.
PLAUSIBLE = {"matmul_flops": (1e9, 1e16), "mem_bandwidth": (4e9, 1e14),
             "attention_flops": (1e8, 1e16)}
# At several threads a rate below this share of one thread's is a disturbed measurement.
THREAD_FLOOR = 0.5
MATMUL_ROWS = (8, 32, 128, 512)  # rows of the products the matmul rate is fitted to


class CalibrationError(TokpipeError):
    """Rates that stayed implausible over every round. `rates`: the best measured, with
    each implausible figure replaced by one thread's where it was measured."""

    def __init__(self, message: str, rates: DeviceRates):
        super().__init__(message)
        self.rates = rates


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: str, budget: float = 0.05) -> float:
    """Fastest of repeated calls over about `budget` seconds (the minimum shrugs off
    other processes that share the device)."""
    fn()
    sync(device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return min(samples)


def matmul_fit(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(peak, m_half) from 1/rate = 1/peak + (m_half/peak) / m, least squares."""
    k = 1024
    w = torch.randn(k, k, device=device, dtype=dtype)
    points = []
    for m in MATMUL_ROWS:
        x = torch.randn(m, k, device=device, dtype=dtype)
        rate = 2 * m * k * k / time_call(lambda x=x: x @ w, device)
        points.append((1 / m, 1 / rate))
    mean_x = statistics.fmean(p[0] for p in points)
    mean_y = statistics.fmean(p[1] for p in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    intercept = mean_y - slope * mean_x
    # A noisy fit (a peak beyond every product measured, or half of it reached only past
    # the largest one) falls back to the best rate seen.
    if intercept <= 0 or slope < 0 or slope / intercept > MATMUL_ROWS[-1]:
        return 1 / min(p[1] for p in points), 0.0
    return 1 / intercept, slope / intercept


def attention_rate(device: str, dtype: torch.dtype) -> float:
    heads, q_len, kv_len, dim = 4, 256, 1024, 64
    q = torch.randn(1, heads, q_len, dim, device=device, dtype=dtype)
    kv = torch.randn(1, heads, kv_len, dim, device=device, dtype=dtype)
    flops = heads * q_len * kv_len * (4 * dim + 5)  # as the cost pass counts it
    return flops / time_call(lambda: F.scaled_dot_product_attention(q, kv, kv), device)


def causal_tile(device: str, dtype: torch.dtype) -> float:
    """Tile width that explains the causal kernel's time on a square n x n block: it
    computes n * (n + tile) / 2 scores where n * n / 2 are needed."""
    n = 1024
    q = torch.randn(1, 4, n, 64, device=device, dtype=dtype)
    full = time_call(lambda: F.scaled_dot_product_attention(q, q, q), device)
    causal = time_call(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                       device)
    return min(max(n * (2 * causal / full - 1), 0.0), float(n))


def bandwidth(device: str, dtype: torch.dtype) -> float:
    # On a CPU a chunk's activations and a layer's weights live in the last-level cache, so
    # measure at that size (12 MB moved); on a GPU stream well past L2.
    a = torch.randn(1 << (20 if device == "cpu" else 26), device=device, dtype=dtype)
    b = torch.randn_like(a)
    for _ in range(10):  # wake the thread pool before timing
        a + b
    return 3 * a.numel() * a.element_size() / time_call(lambda: a + b, device)


def overhead(device: str) -> float:
    a = torch.ones(1, device=device)
    return time_call(lambda: a + a, device, budget=0.02)


def one_round(device: str, dtype: torch.dtype) -> DeviceRates:
    """One measurement of every rate, bandwidth first."""
    streamed = bandwidth(device, dtype)
    peak, half = matmul_fit(device, dtype)
    return DeviceRates(matmul_flops=peak, mem_bandwidth=streamed,
                       attention_flops=attention_rate(device, dtype),
                       per_op_overhead=overhead(device), matmul_half=half,
                       causal_tile=causal_tile(device, dtype))


def best(a: DeviceRates, b: DeviceRates) -> DeviceRates:
    """The better figure of each kind (the matmul peak and half-rate rows as a pair)."""
    rows = MATMUL_ROWS[-1]
    fit = a if a.matmul_rate(rows) >= b.matmul_rate(rows) else b
    return replace(a, matmul_flops=fit.matmul_flops, matmul_half=fit.matmul_half,
                   mem_bandwidth=max(a.mem_bandwidth, b.mem_bandwidth),
                   attention_flops=max(a.attention_flops, b.attention_flops),
                   per_op_overhead=min(a.per_op_overhead, b.per_op_overhead))


def problems(rates: DeviceRates, single: DeviceRates | None = None) -> list[str]:
    """What is implausible in `rates`: a figure outside PLAUSIBLE, or below THREAD_FLOOR of
    `single` (the same device's at one thread)."""
    found = []
    for name, (low, high) in PLAUSIBLE.items():
        value = getattr(rates, name)
        if not low <= value <= high:
            found.append(f"{name} {value:.3g} is outside [{low:.0e}, {high:.0e}]")
    if single is not None:
        rows = MATMUL_ROWS[-1]
        pairs = {"mem_bandwidth": (rates.mem_bandwidth, single.mem_bandwidth),
                 f"matmul rate at {rows} rows": (rates.matmul_rate(rows),
                                                 single.matmul_rate(rows))}
        for name, (value, one) in pairs.items():
            if value < THREAD_FLOOR * one:
                found.append(f"{name} {value:.3g} is below {THREAD_FLOOR:.0%} of one "
                             f"thread's {one:.3g}")
    return found


def floored(rates: DeviceRates, single: DeviceRates | None) -> DeviceRates:
    """`rates` with its bandwidth and matmul fit at least `single`'s (one thread's)."""
    if single is None:
        return rates
    rows = MATMUL_ROWS[-1]
    fit = rates if rates.matmul_rate(rows) >= single.matmul_rate(rows) else single
    return replace(rates, mem_bandwidth=max(rates.mem_bandwidth, single.mem_bandwidth),
                   matmul_flops=fit.matmul_flops, matmul_half=fit.matmul_half)


def single_thread(device: str, dtype: torch.dtype) -> DeviceRates:
    """Bandwidth and matmul fit at one thread: what several threads must not fall below."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        streamed = bandwidth(device, dtype)
        peak, half = matmul_fit(device, dtype)
    finally:
        torch.set_num_threads(previous)
    return DeviceRates(matmul_flops=peak, mem_bandwidth=streamed, attention_flops=1.0,
                       per_op_overhead=0.0, matmul_half=half)


def measure(device: str, dtype: torch.dtype) -> DeviceRates:
    """The rates of `device` at the current thread count: up to ROUNDS rounds, the best
    figure of each kind, until they are plausible. Raises CalibrationError when they stay
    implausible."""
    several = device == "cpu" and torch.get_num_threads() > 1
    single = single_thread(device, dtype) if several else None
    rates = one_round(device, dtype)
    for _ in range(ROUNDS - 1):
        if not problems(rates, single):
            break
        rates = best(rates, one_round(device, dtype))
    found = problems(rates, single)
    if found:
        threads = f" at {torch.get_num_threads()} threads" if device == "cpu" else ""
        raise CalibrationError(
            f"calibrating {device}{threads} gave implausible rates over {ROUNDS} rounds: "
            f"{'; '.join(found)} (another process busy on its cores?)",
            floored(rates, single))
    return rates
