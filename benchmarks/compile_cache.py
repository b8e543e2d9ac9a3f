"""A fresh process's first pipelined call with Inductor stages: with an empty Inductor cache
against one an earlier process filled (every rank and every run of a service is such a
fresh process).

    python benchmarks/compile_cache.py            # --name pixart-sigma-xl-2-1024-ms

Each run is its own process, one thread, with the cache directory of this benchmark
(emptied first); prints each run's first-call seconds and Inductor's cache counters, then
the ratio of the cold run to the warm ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

from benchmarks._args import one_of, parser_for, positive_int


def one_run(name: str, layers: int) -> dict:
    """In this process: the released pipeline's transformer, compiled with the tokpipe
    backend (Inductor stages), called once."""
    import warnings

    from torch._dynamo.utils import counters

    import tokpipe_compiler as tp
    from tokpipe_compiler.released.pipelines import pipeline

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    pipe, kwargs = pipeline(name, layers=layers, grid=(16, 16))
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="inductor")
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    pipe(**kwargs, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {"seconds": seconds, "cache": cache}


def arguments() -> argparse.ArgumentParser:
    from tokpipe_compiler import released

    parser = parser_for(__doc__)
    parser.add_argument("--name", type=one_of(released.NAMES, "released config"),
                        default="pixart-sigma-xl-2-1024-ms", help="the released model")
    parser.add_argument("--layers", type=positive_int, default=1, help="blocks of each kind")
    parser.add_argument("--warm-runs", type=positive_int, default=2,
                        help="runs after the cold one, each with the cache it filled")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.name, args.layers)))
        return
    cache_dir = os.path.join(tempfile.gettempdir(), "tokpipe_compile_cache_benchmark")
    shutil.rmtree(cache_dir, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TQDM_DISABLE": "1"}
    runs = []
    for k in range(1 + args.warm_runs):
        out = subprocess.run([sys.executable, __file__, "--one-run", "--name", args.name,
                              "--layers", str(args.layers)], env=env, check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        label = "cold cache" if k == 0 else "warm cache"
        print(f"run {k + 1} ({label}): first call {runs[-1]['seconds']:.2f} s, "
              f"{runs[-1]['cache']}", flush=True)
    warm = min(r["seconds"] for r in runs[1:])
    print(f"{args.name}: cold {runs[0]['seconds']:.2f} s, warm {warm:.2f} s: "
          f"{runs[0]['seconds'] / warm:.2f}x")


if __name__ == "__main__":
    main()
