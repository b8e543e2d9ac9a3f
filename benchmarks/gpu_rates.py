"""What a GPU sustains at the shapes a chunked DiT step runs, against the cost model's figures.

    python benchmarks/gpu_rates.py [--device cuda] [--dtype bfloat16] [--widths 1152 3072]
        [--rows 512 1024 2048 4096 8192] [--chunks 1 2 4 8]

The simulator prices a chunk's matrix products by shape, in waves of output tiles over the
GPU's multiprocessors, and its attention by score and padded head dim
(`costmodel/hardware.py`, the H200 preset, fitted to this benchmark's output). Chunking
shrinks the rows m and the query count n: this measures what that costs on the device.

- matmul: x [m, C] @ W [C, 4C] (an MLP's first linear) and x [m, C] @ W [C, C] (an
  attention projection), for each width C and row count m (rows = tokens x batch).
- attention: SDPA (the backend PyTorch picks), a stale chunk of n = L / M queries over
  all L keys, at PixArt's heads (2 x 16 heads of 72, L = 4096), the same with heads of 64
  and 128, and FLUX.1's (1 x 24 heads of 128, L = 4608).

TFLOP/s from CUDA events (the median of --reps); 'vs model' is measured over the H200
preset's rate at that shape. 'one call': events around each call, so a short kernel's time
includes the gap while the host launches it; 'graphed' (CUDA only): --reps calls captured
in one CUDA graph and replayed, the device's time per call when launches are queued (as
in a CUDA-graphed or long stage). On a CPU it runs too (float32, host timer, no graphed
column), for a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

from benchmarks._args import parser_for, positive_int
from tokpipe_compiler.costmodel.calibrate import GEMM_TILE
from tokpipe_compiler.costmodel.hardware import DEVICES
from tokpipe_compiler.costmodel.symbolic import ATTENTION_HEAD_STEP, padded_head

ATTENTION_CASES = (("pixart", 2, 16, 72, 4096), ("d64", 2, 16, 64, 4096),
                   ("d128", 2, 16, 128, 4096), ("flux", 1, 24, 128, 4608))


def median_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of `fn` after two warmup calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graphed_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Milliseconds per call of `reps` calls replayed from one CUDA graph (nan off CUDA)."""
    if not device.startswith("cuda"):
        return float("nan")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def matmul_rows(args: argparse.Namespace, dtype: torch.dtype) -> None:
    model = DEVICES["h200"].rates()
    print(f"\nmatmul x [m, C] @ W [C, out] ({args.dtype}, median of {args.reps}); the H200 "
          f"preset: waves of {GEMM_TILE} x {GEMM_TILE} tiles over {model.sms} SMs, "
          f"{model.matmul_flops / 1e12:.0f} TFLOP/s in full waves")
    print(f"{'C':>6} {'out':>6} {'m':>6} {'one call':>9} {'graphed':>8} {'vs model':>9}  "
          f"(TFLOP/s; vs model: graphed over the preset's waves of tiles)")
    for width in args.widths:
        for out in (4 * width, width):
            w = torch.randn(width, out, device=args.device, dtype=dtype)
            for m in args.rows:
                x = torch.randn(m, width, device=args.device, dtype=dtype)
                flops = 2 * m * width * out
                one = flops / median_ms(lambda x=x, w=w: x @ w, args.device, args.reps) / 1e9
                graphed = flops / graphed_ms(lambda x=x, w=w: x @ w, args.device, args.reps) / 1e9
                expected = flops / model.gemm_seconds(m, out, width) / 1e12
                print(f"{width:>6} {out:>6} {m:>6} {one:>9.1f} {graphed:>8.1f} "
                      f"{graphed / expected:>8.2f}x", flush=True)


def attention_chunks(args: argparse.Namespace, dtype: torch.dtype) -> None:
    model = DEVICES["h200"].rates()
    print(f"\nSDPA TFLOP/s, a stale chunk of L / M queries over L keys ({args.dtype}); "
          f"vs model: graphed over the preset's {model.score_seconds * 1e12:.2f} ps a score "
          f"plus {model.attention_flops / 1e12:.0f} TFLOP/s over head dims padded to "
          f"{ATTENTION_HEAD_STEP}")
    print(f"{'case':>7} {'B x H x D':>12} {'L':>6} {'M':>3} {'n':>6} {'one call':>9} "
          f"{'graphed':>8} {'vs model':>9}")
    for name, batch, heads, dim, length in ATTENTION_CASES:
        def rand(n: int, b=batch, h=heads, d=dim) -> torch.Tensor:
            return torch.randn(b, h, n, d, device=args.device, dtype=dtype)

        k, v = rand(length), rand(length)
        for chunks in args.chunks:
            n = length // chunks
            q = rand(n)
            def attend(q=q, k=k, v=v) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v)

            scores = batch * heads * n * length
            flops = 4 * scores * dim
            one = flops / median_ms(attend, args.device, args.reps) / 1e9
            graphed = flops / graphed_ms(attend, args.device, args.reps) / 1e9
            expected = flops / model.attention_by_score(scores, 4 * scores * padded_head(dim))
            shape = f"{batch}x{heads}x{dim}"
            print(f"{name:>7} {shape:>12} {length:>6} {chunks:>3} {n:>6} {one:>9.1f} "
                  f"{graphed:>8.1f} {graphed / (expected / 1e12):>8.2f}x", flush=True)


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--device", default="cuda", help="the torch device (cpu: a smoke run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="the operands' dtype (float32 on a CPU)")
    parser.add_argument("--widths", type=positive_int, nargs="+", default=[1152, 3072],
                        help="model widths C of the matmul rows")
    parser.add_argument("--rows", type=positive_int, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192],
                        help="row counts m (tokens x batch) of the matmul rows")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="chunk counts M of the attention rows (n = L / M queries)")
    parser.add_argument("--reps", type=positive_int, default=20,
                        help="timed calls a shape (the median)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_rates: no CUDA device here; pass --device cpu for a smoke run")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    with torch.no_grad():
        matmul_rows(args, dtype)
        attention_chunks(args, dtype)


if __name__ == "__main__":
    main()
