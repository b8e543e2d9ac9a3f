"""Seconds from a Cost: rates of the local device, measured once and cached on disk.

rates = load_or_measure("cpu")          # ~2 s the first time, then read from the cache
                                        # (measurement: costmodel/measure.py)
seconds(graph_cost(nodes, 4096), rates, n=512, c=4096)
"""

from __future__ import annotations

import json
import math
import os
import platform
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import sympy
import torch

from tokpipe_compiler.costmodel.cost import TEXT, TILE, C, Cost, N

CACHE_ENV = "TOKPIPE_CACHE_DIR"
# Rates that load_or_measure returns instead of measuring (see assume_rates).
_ASSUMED: dict[str, DeviceRates] = {}
# What load_or_measure hands its rates to, with the rates it has passed on (see
# shared_rates); innermost last.
Share = Callable[[str, Callable[[], "DeviceRates"]], "DeviceRates"]
_SHARING: list[tuple[Share, dict]] = []
# Rates this process plans with after a refused measurement, by (device, threads): it
# warns and measures once (see _local).
_UNCACHED: dict[tuple[str, int], DeviceRates] = {}


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


# ---- measurement and cache -------------------------------------------------------------


def measure_rates(device: str = "cpu", threads: int | None = None) -> DeviceRates:
    """Measure the rates of `device` (about a second a round, up to measure.ROUNDS), with
    `threads` CPU threads. Raises measure.CalibrationError when the figures stay
    implausible (a machine too busy to measure)."""
    from tokpipe_compiler.costmodel import measure

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            rates = measure.measure(device, dtype)
            if torch.device(device).type == "cuda":  # waves of tiles, attention per score
                from tokpipe_compiler.costmodel.gpu_rates import refine

                rates = refine(rates, device, dtype, measure.time_call)
            return rates
    finally:
        torch.set_num_threads(previous)


def cache_path(device: str = "cpu", threads: int | None = None) -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tokpipe_compiler"
    threads = threads if threads is not None else torch.get_num_threads()
    name = device.replace(":", "-").replace("/", "-")
    return Path(root) / f"rates-{name}-{threads}.json"


def cache_key(device: str = "cpu", threads: int | None = None) -> dict[str, object]:
    """What cached rates hold for: the device, its thread count, this torch and the
    hardware (the CPU's model and cores, or the GPU's name)."""
    threads = threads if threads is not None else torch.get_num_threads()
    if torch.device(device).type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{_cpu_model()}, {os.cpu_count()} cores"
    return {"device": device, "threads": threads, "torch": torch.__version__,
            "hardware": hardware}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def save_rates(rates: DeviceRates, device: str = "cpu", threads: int | None = None) -> Path:
    """Write `rates` to the cache as this machine's for `device` at `threads`."""
    path = cache_path(device, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": cache_key(device, threads), "rates": asdict(rates)},
                               indent=1))
    return path


def _cached(device: str, threads: int | None) -> DeviceRates | None:
    """The cached rates, where they were measured for what this process runs on (the same
    device, threads, torch and hardware) and are plausible."""
    from tokpipe_compiler.costmodel.measure import problems

    try:
        cached = json.loads(cache_path(device, threads).read_text())
        if cached.get("key") != cache_key(device, threads):
            return None
        rates = cached["rates"]
        if set(rates) != {f.name for f in fields(DeviceRates)}:
            return None  # written by a version with other rates
        rates = DeviceRates(**rates)
    except (OSError, TypeError, ValueError, KeyError, AttributeError):
        return None  # missing or corrupt
    return None if problems(rates) else rates


def load_or_measure(
    device: str = "cpu", threads: int | None = None, refresh: bool = False
) -> DeviceRates:
    """Cached rates of `device`, measured and written to the cache when missing, measured
    for other hardware, threads or torch, or implausible. "meta" (a model planned without
    memory behind it) has nothing to time: it gets the CPU's rates, which weigh the nodes
    against each other as well as any, unless assume_rates gave it others."""
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
    """This process's rates: read from the cache, or measured and cached. Rates that stay
    implausible are used (one thread's figures where those are higher) with a warning, and
    kept in this process only, so the next process measures again."""
    from tokpipe_compiler.costmodel.measure import CalibrationError

    key = (device, threads if threads is not None else torch.get_num_threads())
    cached = None if refresh else _cached(device, threads) or _UNCACHED.get(key)
    if cached is not None:
        return cached
    try:
        rates = measure_rates(device, threads)
    except CalibrationError as err:
        warnings.warn(f"{err}; planning with the best figures measured (one thread's "
                      "where higher), not cached: the next process measures again (or "
                      "write rates with calibrate.save_rates)", stacklevel=3)
        _UNCACHED[key] = err.rates
        return err.rates
    save_rates(rates, device, threads)
    return rates


@contextmanager
def shared_rates(share: Share) -> Iterator[None]:
    """Within the block, load_or_measure returns `share(device, local)`, where `local()`
    gives the rates it would return, asking once per device and thread count (the ranks of
    a process group plan with rank 0's: `stage_programs.distributed.planned_alike`)."""
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
