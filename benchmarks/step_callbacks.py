"""What a step-end callback costs a parallelized pipeline: the ring without one, the ring
with one, and per call with one (how such calls ran before callbacks ran in the ring), side
by side in one run on two gloo ranks.

    python benchmarks/step_callbacks.py [--names flux1-dev wan2.1-t2v-1.3b] [--steps 8]

Each model is its released widths and text length in its diffusers pipeline (random
weights, `--layers` blocks, guided, latents out). The callback keeps a preview of each
step's latents (a copy, as an app would decode it). Each rank times the three in
alternation after a first call each (tracing, planning), median of `--rounds`; both ranks
agree on the result, rank 0 prints seconds per generation and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

from benchmarks._args import one_of, parser_for, positive_float, positive_int

DEFAULT_NAMES = ["flux1-dev", "wan2.1-t2v-1.3b"]
GRIDS = {"flux1-dev": (32, 32), "wan2.1-t2v-1.3b": (2, 32, 32)}


def _generations(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per variant: a function running one generation."""
    import tokpipe_compiler as tp
    from tokpipe_compiler.released.pipelines import pipeline, small_grid

    grid = GRIDS.get(name, small_grid(name))
    options = {"stages": 2, "chunks": args.chunks, "mode": args.mode, "warmup_steps": 1,
               "compiler": args.compiler}
    previews: list[torch.Tensor] = []

    def preview(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        previews.append(tensors["latents"].clone())
        return tensors

    def variant(ring: bool, callback: bool):
        pipe, kwargs = pipeline(name, layers=args.layers, grid=grid)
        pipe.set_progress_bar_config(disable=True)
        tp.pipelines.parallelize(pipe, ring=ring, **options)
        extra = {"callback_on_step_end": preview} if callback else {}

        def generate() -> torch.Tensor:
            previews.clear()
            out = pipe(**kwargs, **extra, num_inference_steps=args.steps,
                       generator=torch.Generator().manual_seed(0))
            return torch.as_tensor(out.images if hasattr(out, "images") else out.frames)

        return generate

    return {"ring": variant(True, False), "ring + callback": variant(True, True),
            "per call + callback": variant(False, True)}


def _rank(rank: int, world: int, names: list[str], args: argparse.Namespace) -> dict:
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="tokpipe: .* runs per call")
    results = {}
    for name in names:
        runs = _generations(name, args)
        outs = {key: run() for key, run in runs.items()}  # trace, plan, compile
        times: dict[str, list[float]] = {key: [] for key in runs}
        for _ in range(args.rounds):
            for key, run in runs.items():
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
        ring = outs["ring"]
        results[name] = {
            "seconds": {key: statistics.median(t) for key, t in times.items()},
            "callback vs ring": (outs["ring + callback"] - ring).abs().max().item()
            / ring.abs().max().item()}
    return results


def arguments() -> argparse.ArgumentParser:
    from tokpipe_compiler import released

    parser = parser_for(__doc__)
    parser.add_argument("--names", nargs="+", type=one_of(released.NAMES, "released config"),
                        default=DEFAULT_NAMES, metavar="NAME",
                        help=f"released models, of {', '.join(released.NAMES)}")
    parser.add_argument("--steps", type=positive_int, default=8, help="steps a generation")
    parser.add_argument("--layers", type=positive_int, default=1, help="blocks of each kind")
    parser.add_argument("--chunks", type=positive_int, default=2, help="chunks a stage (2 stages)")
    parser.add_argument("--mode", default="stale", choices=["stale", "sync"],
                        help="the pipelined mode")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                        help="how tokpipe compiles its stages")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed generations of each variant (the median)")
    parser.add_argument("--timeout", type=positive_float, default=1800.0,
                        help="seconds the two ranks may take")
    return parser


def main() -> None:
    from tokpipe_compiler.run_device import say_if_busy
    from tokpipe_compiler.runtime.launch import launch

    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    results = launch(_rank, 2, args=(args.names, args), timeout=args.timeout)
    print(f"{args.steps} steps, {args.mode}, chunks={args.chunks}, {args.compiler} stages, "
          f"2 gloo ranks x 1 thread; seconds per generation (median of {args.rounds}), "
          "rank 0 (rank 1 in brackets)")
    print(f"{'model':<18} {'ring':>12} {'ring+callback':>14} {'per call+callback':>18} "
          f"{'callback cost':>14} {'ring gain':>10} {'diff':>8}")
    for name in args.names:
        zero, one = results[0][name], results[1][name]
        s, s1 = zero["seconds"], one["seconds"]
        cost = s["ring + callback"] / s["ring"]
        gain = s["per call + callback"] / s["ring + callback"]
        print(f"{name:<18} {s['ring']:6.2f} [{s1['ring']:4.2f}] "
              f"{s['ring + callback']:7.2f} [{s1['ring + callback']:4.2f}] "
              f"{s['per call + callback']:10.2f} [{s1['per call + callback']:4.2f}] "
              f"{cost:13.2f}x {gain:9.2f}x {zero['callback vs ring']:8.1e}")


if __name__ == "__main__":
    main()
