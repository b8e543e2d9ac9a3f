"""What a process holds as it parallelizes and runs pipeline after pipeline.

    python benchmarks/pipeline_memory.py [--model wan2.1-1.3b] [--pipelines 4] [--steps 3]
    python benchmarks/pipeline_memory.py --model sd3-medium --sizes 24

A released-width transformer (one block, a small grid: tests/fixtures/released_pipelines.py)
inside its diffusers pipeline, with guidance. In one process, one thread: a new pipeline is
built, parallelized (2 stages x 2 chunks, stale, eager stages), run once and dropped, again
and again; the same with the pipeline left serial. After each: the resident set (after
`gc.collect()`; diffusers' pipelines are reference cycles) and the K/V the ring's program
holds now and held during the generation. A process that kept what each pipeline traced
grows by one transformer per pipeline; a ring that kept its caches after its last step
holds them through the VAE decode.

`--sizes N`: one parallelized pipeline run at N prompt lengths (the prompt embeddings cut
8 tokens shorter each time), as a service whose requests differ in length: the resident
set and the traces' fake tensor modes held after each. Each length is a new input
signature; past the 8 a ring keeps, neither should grow.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from tests.fixtures.pipelines import generate
from tests.fixtures.released_pipelines import RELEASED
from tokpipe_compiler.inspection.memory import memory_report
from tokpipe_compiler.inspection.report import human_bytes


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def run(name: str, parallel: bool, steps: int) -> tuple[str, str]:
    """One pipeline built, run and dropped: (K/V held now, K/V held by the generation)."""
    pipe, kwargs = RELEASED[name]()
    if parallel:
        tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="stale", compiler="eager")
    generate(pipe, kwargs, steps=steps)
    held = during = "-"
    if parallel:
        (program,) = tp.pipelines.programs(pipe)  # the ring's
        now = sum(t.numel() * t.element_size() for c in program.branches.values()
                  for t in c.buffers.values())
        held = human_bytes(now)
        during = human_bytes(sum(s.kv_measured for s in memory_report(program).stages))
    del pipe, kwargs
    gc.collect()
    return held, during


def sizes(name: str, count: int, steps: int) -> None:
    """One parallelized pipeline run at `count` prompt lengths: what it holds after each."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pipe, kwargs = RELEASED[name]()
    embeds = [k for k in ("prompt_embeds", "negative_prompt_embeds") if k in kwargs]
    if not embeds:
        raise SystemExit(f"--sizes needs a fixture passing prompt_embeds; {name}'s does not")
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="stale", compiler="eager")
    start = resident()
    print(f"{name}, one block, one parallelized pipeline; resident set over its build "
          f"({human_bytes(start)}) after each prompt length")
    print(f"{'length':>8} {'resident':>10} {'fake modes':>11}")
    full = kwargs[embeds[0]].shape[1]
    for i in range(count):
        length = max(full - 8 * i, 1)
        generate(pipe, {**kwargs, **{k: kwargs[k][:, :length] for k in embeds}}, steps=steps)
        gc.collect()
        with warnings.catch_warnings():  # isinstance on a deprecated torch alias warns
            warnings.simplefilter("ignore")
            modes = sum(isinstance(o, FakeTensorMode) for o in gc.get_objects())
        print(f"{length:>8} {human_bytes(resident() - start):>10} {modes:>11}", flush=True)


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--model", default="wan2.1-1.3b", choices=sorted(RELEASED),
                        help="the released-width fixture")
    parser.add_argument("--pipelines", type=positive_int, default=4,
                        help="pipelines built, run and dropped, serial and then ring")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps a generation")
    parser.add_argument("--sizes", type=positive_int, default=None,
                        help="instead: one parallelized pipeline run at this many prompt "
                             "lengths")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    if args.sizes is not None:
        sizes(args.model, args.sizes, args.steps)
        return
    start = resident()
    print(f"{args.model}, one block, in one process; resident set over the start "
          f"({human_bytes(start)}) after each pipeline is dropped")
    print(f"{'run':<10} {'pipeline':>8} {'resident':>10} {'K/V now':>10} {'K/V during':>11}")
    for parallel in (False, True):
        for i in range(args.pipelines):
            held, during = run(args.model, parallel, args.steps)
            kind = "ring" if parallel else "serial"
            print(f"{kind:<10} {i + 1:>8} {human_bytes(resident() - start):>10} "
                  f"{held:>10} {during:>11}", flush=True)


if __name__ == "__main__":
    main()
