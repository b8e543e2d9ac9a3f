"""Seconds from a Cost: rates of the local device, measured once and cached on disk.

rates = load_or_measure("cpu")          # ~2 s the first time, then read from the cache
seconds(graph_cost(nodes, 4096), rates, n=512, c=4096)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import sympy
import torch
import torch.nn.functional as F

from tokpipe_compiler.costmodel.cost import TEXT, TILE, C, Cost, N

CACHE_ENV = "TOKPIPE_CACHE_DIR"
# Rates that load_or_measure returns instead of measuring (see assume_rates).
_ASSUMED: dict[str, DeviceRates] = {}
# What load_or_measure hands its rates to, with the rates it has passed on (see
# shared_rates); innermost last.
Share = Callable[[str, Callable[[], "DeviceRates"]], "DeviceRates"]
_SHARING: list[tuple[Share, dict]] = []


@dataclass
class DeviceRates:
    """What one device sustains.

    matmul_flops: peak FLOP/s of large matmuls. A matmul whose smaller dimension is m runs at
    matmul_flops * m / (m + matmul_half): small chunks make skinny, slower matmuls.
    mem_bandwidth: B/s of a streaming elementwise op.
    attention_flops: FLOP/s of the fused attention kernel; with score_seconds, FLOP/s of
    its matrix products over padded head dims (Cost.attention_padded).
    per_op_overhead: seconds of launch/dispatch per kernel-running node.
    causal_tile: key positions per tile of the causal attention kernel (it computes whole
    tiles, so the diagonal block of a chunk costs more than its unmasked half).
    sms: multiprocessors of a GPU (0: not modelled). With them a product of known shape
    runs as waves of GEMM_TILE x GEMM_TILE output tiles, sms at a time, each multiprocessor
    at matmul_flops / sms: a chunk too small to fill the GPU pays for a whole wave.
    score_seconds: seconds an attention kernel spends per score besides its products (the
    softmax; 0: attention timed by its FLOPs alone).
    """

    matmul_flops: float
    mem_bandwidth: float
    attention_flops: float
    per_op_overhead: float
    matmul_half: float = 0.0
    causal_tile: float = 0.0
    sms: int = 0
    score_seconds: float = 0.0

    def matmul_rate(self, m: float) -> float:
        return self.matmul_flops * m / (m + self.matmul_half)

    def gemm_seconds(self, rows: float, cols: int, depth: int) -> float:
        """One [rows, depth] @ [depth, cols] product in waves of output tiles (sms > 0)."""
        tiles = math.ceil(rows / GEMM_TILE) * math.ceil(cols / GEMM_TILE)
        per_tile = 2 * GEMM_TILE * GEMM_TILE * depth * self.sms / self.matmul_flops
        return math.ceil(tiles / self.sms) * per_tile

    def attention_by_score(self, scores: float, padded_flops: float) -> float:
        """Attention of `scores` query-key scores whose products over padded head dims are
        `padded_flops` (score_seconds > 0)."""
        return scores * self.score_seconds + padded_flops / self.attention_flops


# Output tile of a GPU's matrix product kernels: on an H200 (bf16, 20 shapes of DiT
# widths 1152 and 3072, 512-8192 rows) waves of 128 x 128 tiles explain the measured times
# within 10% (BENCHMARKS.md, "Matmul and attention rates at chunked shapes").
GEMM_TILE = 128


def seconds(cost: Cost, rates: DeviceRates, n: int, c: int, text: float = 1.0) -> float:
    """Predicted time of `cost` for a chunk of n tokens attending over c tokens that
    computes `text` of the text segments (cost.TEXT)."""
    tile = round(rates.causal_tile)
    flops, nbytes, mm, attn = cost.at(n, c, tile, text)
    gemms = cost.gemms_at(n, c, text) if rates.sms else []
    scores = cost.attention_at(n, c, tile, text) if rates.score_seconds else None
    return _combine(flops, nbytes, mm, attn, cost.launches_at(text), rates,
                    n + text * cost.text_rows, gemms, scores)


def time_fn(cost: Cost, rates: DeviceRates) -> Callable[..., float]:
    """`seconds` as a fast function of (n, c, text=1), for dynamic programs that call it
    often."""
    exprs = [cost.flops, cost.bytes, cost.matmul_flops, cost.attention_flops]
    if rates.score_seconds:
        exprs += [cost.attention_scores, cost.attention_padded]
    tiled = [sympy.sympify(e).subs(TILE, round(rates.causal_tile)) for e in exprs]
    gemms = cost.gemms if rates.sms else ()
    evaluate = sympy.lambdify((N, C, TEXT), tiled + [g.rows for g in gemms], "math")

    def predict(n: int, c: int, text: float = 1.0) -> float:
        values = [float(v) for v in evaluate(n, c, text)]
        flops, nbytes, mm, attn = values[:4]
        scores = tuple(values[4:len(exprs)]) or None
        rows = values[len(exprs):]
        shapes = [(r, g.cols, g.depth, g.count) for r, g in zip(rows, gemms, strict=True)]
        return _combine(flops, nbytes, mm, attn, cost.launches_at(text), rates,
                        n + text * cost.text_rows, shapes, scores)

    return predict


def _combine(
    flops: float, nbytes: float, mm: float, attn: float, launches: float,
    rates: DeviceRates, rows: float, gemms: list[tuple[float, int, int, int]],
    scores: tuple[float, float] | None = None,
) -> float:  # fmt: skip
    """Seconds of the chunk's work; `rows`: its tokens with the text it computes, which set
    the rate of its matrix products; `gemms`: (rows, cols, depth, count) of the products
    timed by shape (their FLOPs are part of mm); `scores`: (scores, padded FLOPs) of its
    attention, timed by score when the device has score_seconds."""
    shaped = sum(count * rates.gemm_seconds(r, cols, depth) for r, cols, depth, count in gemms)
    rest = max(mm - sum(2 * count * r * cols * depth for r, cols, depth, count in gemms), 0.0)
    if scores is None:
        attention = attn / rates.attention_flops
    else:
        attention = rates.attention_by_score(*scores)
    compute = (
        shaped
        + rest / rates.matmul_rate(max(rows, 1))
        + attention
        + (flops - mm - attn) / rates.matmul_flops
    )
    memory = nbytes / rates.mem_bandwidth
    # Sum, not max: on a 2-core EPYC (1 thread, DiT block of width 384, 16-1024 tokens)
    # the sum put whole-block times at 0.89-1.0x of measured up to 256 tokens (max:
    # 0.87-0.89x) and per-node mean |log error| at 0.43 (max: 0.55); eager kernels do not
    # overlap their loads with arithmetic.
    return compute + memory + launches * rates.per_op_overhead


# ---- measurement -----------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: str, budget: float = 0.05) -> float:
    """Fastest of repeated calls over about `budget` seconds (the minimum shrugs off
    other processes that share the device)."""
    fn()
    _sync(device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return min(samples)


def _matmul_fit(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(peak, m_half) from 1/rate = 1/peak + (m_half/peak) / m, least squares."""
    k = 1024
    w = torch.randn(k, k, device=device, dtype=dtype)
    points = []
    for m in (8, 32, 128, 512):
        x = torch.randn(m, k, device=device, dtype=dtype)
        rate = 2 * m * k * k / _time(lambda x=x: x @ w, device)
        points.append((1 / m, 1 / rate))
    mean_x = statistics.fmean(p[0] for p in points)
    mean_y = statistics.fmean(p[1] for p in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    intercept = mean_y - slope * mean_x
    if intercept <= 0 or slope < 0:  # noisy fit: fall back to the best rate seen
        return 1 / min(p[1] for p in points), 0.0
    return 1 / intercept, slope / intercept


def _attention_rate(device: str, dtype: torch.dtype) -> float:
    heads, q_len, kv_len, dim = 4, 256, 1024, 64
    q = torch.randn(1, heads, q_len, dim, device=device, dtype=dtype)
    kv = torch.randn(1, heads, kv_len, dim, device=device, dtype=dtype)
    flops = heads * q_len * kv_len * (4 * dim + 5)  # as the cost pass counts it
    return flops / _time(lambda: F.scaled_dot_product_attention(q, kv, kv), device)


def _causal_tile(device: str, dtype: torch.dtype) -> float:
    """Tile width that explains the causal kernel's time on a square n x n block: it
    computes n * (n + tile) / 2 scores where n * n / 2 are needed."""
    n = 1024
    q = torch.randn(1, 4, n, 64, device=device, dtype=dtype)
    full = _time(lambda: F.scaled_dot_product_attention(q, q, q), device)
    causal = _time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device)
    return min(max(n * (2 * causal / full - 1), 0.0), float(n))


def _bandwidth(device: str, dtype: torch.dtype) -> float:
    # On a CPU a chunk's activations and a layer's weights live in the last-level cache, so
    # measure at that size (12 MB moved); on a GPU stream well past L2.
    a = torch.randn(1 << (20 if device == "cpu" else 26), device=device, dtype=dtype)
    b = torch.randn_like(a)
    return 3 * a.numel() * a.element_size() / _time(lambda: a + b, device)


def _overhead(device: str) -> float:
    a = torch.ones(1, device=device)
    return _time(lambda: a + a, device, budget=0.02)


def measure_rates(device: str = "cpu", threads: int | None = None) -> DeviceRates:
    """Measure the rates of `device` (about a second), with `threads` CPU threads."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            peak, half = _matmul_fit(device, dtype)
            rates = DeviceRates(
                matmul_flops=peak,
                mem_bandwidth=_bandwidth(device, dtype),
                attention_flops=_attention_rate(device, dtype),
                per_op_overhead=_overhead(device),
                matmul_half=half,
                causal_tile=_causal_tile(device, dtype),
            )
            if torch.device(device).type == "cuda":  # waves of tiles, attention per score
                from tokpipe_compiler.costmodel.gpu_rates import refine

                rates = refine(rates, device, dtype, _time)
            return rates
    finally:
        torch.set_num_threads(previous)


def cache_path(device: str = "cpu", threads: int | None = None) -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tokpipe_compiler"
    threads = threads if threads is not None else torch.get_num_threads()
    name = device.replace(":", "-").replace("/", "-")
    return Path(root) / f"rates-{name}-{threads}.json"


def load_or_measure(
    device: str = "cpu", threads: int | None = None, refresh: bool = False
) -> DeviceRates:
    """Cached rates of `device`, measured and written to the cache when missing. "meta"
    (a model planned without memory behind it) has nothing to time: it gets the CPU's
    rates, which weigh the nodes against each other as well as any, unless assume_rates
    gave it others."""
    if device in _ASSUMED:
        return _ASSUMED[device]
    if torch.device(device).type == "meta":
        device = "cpu"
    if not _SHARING:
        return _local(device, threads, refresh)
    share, passed = _SHARING[-1]
    key = (device, threads)
    if key not in passed:
        passed[key] = share(device, lambda: _local(device, threads, refresh))
    return passed[key]


def _local(device: str, threads: int | None, refresh: bool) -> DeviceRates:
    """This process's rates: read from the cache, or measured and cached."""
    path = cache_path(device, threads)
    if path.exists() and not refresh:
        try:
            cached = json.loads(path.read_text())
            if set(cached) == {f.name for f in fields(DeviceRates)}:
                return DeviceRates(**cached)
        except (TypeError, ValueError):
            pass
        # a corrupt cache, or one from a version with other rates, is remeasured
    rates = measure_rates(device, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(rates), indent=1))
    return rates


@contextmanager
def shared_rates(share: Share) -> Iterator[None]:
    """Within the block, load_or_measure returns `share(device, local)`, where `local()`
    gives the rates it would return, asking once per device and thread count (the ranks of
    a process group plan with rank 0's: `programs.distributed.planned_alike`)."""
    _SHARING.append((share, {}))
    try:
        yield
    finally:
        _SHARING.pop()


@contextmanager
def assume_rates(device: str, rates: DeviceRates) -> Iterator[None]:
    """Within the block, `device` has `rates` (not measured): a model on "meta" planned
    for hardware this machine does not have (chunks="auto" chooses at these rates)."""
    before = _ASSUMED.get(device)
    _ASSUMED[device] = rates
    try:
        yield
    finally:
        if before is None:
            _ASSUMED.pop(device)
        else:
            _ASSUMED[device] = before


if __name__ == "__main__":
    measured = load_or_measure(refresh=True)
    print(json.dumps(asdict(measured), indent=1))
