"""The cost model against measured stage times on this CPU (1 thread, eager stages).

    python benchmarks/cost_model.py [--quick] [--runs 5] [--chunks 3 4]

(a) DiT-S/2 (12 layers, hidden 384, 6 heads, 64x64 latent), stale mode, 2 stages, 4 chunks:
    each stage's predicted seconds per chunk against the median measured one.
(b) TinyCausalLM (4096 tokens, width 256, 4 layers), causal mode, 2 stages: uniform chunks
    against TeraPipe's slicing with the same count: predicted; measured in process (per-chunk
    stage times combined as a pipeline runs them: sum(t_i) + (S - 1) * max(t_i)); and measured
    as the wall time of one call pipelined on 2 ranks of 1 thread (median of the runs).
(c) DiT: predicted step time of chunks="auto" against fixed chunk counts 1, 2, 4, 8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tokpipe_compiler import Config
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.costmodel.chunk_choice import (
    choose_causal,
    choose_stale,
    slowest_times,
    step_time,
    table_step_time,
)
from tokpipe_compiler.planning.capture import capture
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.chunking import chunk_table
from tokpipe_compiler.runtime.launch import launch
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, benchmarks
from benchmarks._args import parser_for, positive_int
from benchmarks.cpu_pipeline import FULL as DIT_FULL  # the same DiT as the pipeline benchmark
from benchmarks.cpu_pipeline import QUICK as DIT_QUICK
from benchmarks.cpu_pipeline import dit_model
from tests.fixtures.models import TinyCausalLM

LM_FULL = {"tokens": 4096, "width": 256, "layers": 4}
LM_QUICK = {"tokens": 512, "width": 64, "layers": 2}
STAGES = 2


def capture_one(fn, *args: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's one graph of fn(*args), and its example inputs."""
    captured = capture(fn, args, fresh=True)[0]
    return captured.gm, captured.inputs


def measure(plan: Plan, inputs: list, runs: int) -> dict[tuple[int, int], float]:
    """Median compute seconds of each (stage, chunk) over `runs` pipelined calls."""
    program = PipelinedProgram(plan)
    with torch.no_grad():
        for _ in range(plan.config.warmup_steps + 1):  # warmup, then one untimed call
            program(*inputs)
        program.timeline.events.clear()
        for _ in range(runs):
            program(*inputs)
    samples = defaultdict(list)
    for event in program.timeline.events:
        if event.kind == "compute":
            samples[event.stage, event.chunk].append(event.duration)
    return {key: statistics.median(v) for key, v in samples.items()}


def predict(plan: Plan, rates: calibrate.DeviceRates) -> dict[tuple[int, int], float]:
    return {(s.index, c.index): calibrate.seconds(s.cost, rates, plan.chunk_tokens(c),
                                                  plan.context_tokens(c))
            for s in plan.stages for c in plan.chunks}


def stage_times(plan: Plan, rates: calibrate.DeviceRates) -> list:
    return [calibrate.time_fn(s.cost, rates) for s in plan.stages]


def dit(shape: dict):
    model = dit_model(shape)
    t, labels = torch.tensor([500]), torch.tensor([207])

    def forward(latents):
        return model(latents, timestep=t, class_labels=labels).sample

    return capture_one(forward, torch.randn(1, 4, shape["side"], shape["side"]))


def stage_accuracy(gm, inputs, rates, runs: int) -> None:
    plan = build_plan(gm, Config(stages=STAGES, chunks=4, mode="stale", compiler="eager"))
    measured, predicted = measure(plan, inputs, runs), predict(plan, rates)
    print("(a) DiT stage seconds per chunk (stale, 2 stages, 4 chunks)")
    errors = []
    for s in plan.stages:
        p = statistics.fmean(predicted[s.index, c.index] for c in plan.chunks)
        m = statistics.fmean(measured[s.index, c.index] for c in plan.chunks)
        errors.append(abs(p / m - 1))
        print(f"  stage {s.index}: predicted {p * 1e3:8.2f} ms  measured {m * 1e3:8.2f} ms"
              f"  predicted/measured {p / m:.2f}")
    print(f"  median |error| {statistics.median(errors):.1%}")


def auto_vs_fixed(gm, rates) -> None:
    plan = build_plan(gm, Config(stages=STAGES, chunks=STAGES, mode="stale", compiler="eager"))
    times = stage_times(plan, rates)
    print("(c) DiT predicted step time (stale, 2 stages, one call)")
    auto = choose_stale(plan.units, plan.tokens, times)
    for label, table in [("auto", auto),
                         *((str(m), chunk_table(plan.units, m)) for m in (1, 2, 4, 8))]:
        step = table_step_time(table, times, plan.units, plan.tokens, causal=False)
        print(f"  chunks={label:>4} ({len(table)}): {step * 1e3:8.2f} ms")


def combined(per_chunk: dict[tuple[int, int], float], plan: Plan) -> float:
    slowest = [max(per_chunk[s.index, c.index] for s in plan.stages) for c in plan.chunks]
    return step_time(slowest, len(plan.stages))


def causal_model(shape: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """The benchmark's causal transformer and input, seeded: the same in every process."""
    torch.manual_seed(0)
    model = TinyCausalLM(depth=shape["layers"], width=shape["width"], heads=4).eval()
    return model, torch.randn(1, shape["tokens"], shape["width"])


def causal_rank(
    rank: int, world: int, shape: dict, lengths: list[int] | str, runs: int
) -> tuple[float, list[int]]:
    """Median wall seconds of one pipelined call on `world` ranks with chunks=`lengths`, and
    the chunk lengths the plan used."""
    model, x = causal_model(shape)
    backend = tp.backend(stages=world, chunks=lengths, mode="causal", compiler="eager",
                         warmup_steps=0)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    times = []
    with torch.no_grad():
        for k in range(runs + 1):  # the first call plans and is not timed
            dist.barrier()
            start = time.perf_counter()
            compiled(x)
            if k:
                times.append(time.perf_counter() - start)
    (program,) = tp.programs(compiled)
    used = [program.plan.chunk_tokens(c) for c in program.plan.chunks]
    return statistics.median(times), used


def causal_slicing(shape: dict, rates, runs: int, chunks: int) -> None:
    model, x = causal_model(shape)
    gm, inputs = capture_one(model, x)
    config = Config(stages=STAGES, chunks=chunks, mode="causal", compiler="eager")
    uniform = build_plan(gm, config)
    table = choose_causal(uniform.units, uniform.tokens, stage_times(uniform, rates), chunks)
    sliced = build_plan(gm, replace(config, chunks=[uniform.chunk_tokens(c) for c in table]))
    print(f"(b) TinyCausalLM {shape['tokens']} tokens, 2 stages, {chunks} chunks: uniform vs "
          f"TeraPipe slicing (predicted; in process: per-chunk times combined; 2 ranks: wall "
          f"time of a call)")
    results = {}
    for name, plan in (("uniform", uniform), ("terapipe", sliced)):
        slow = slowest_times(plan.chunks, stage_times(plan, rates), plan.units, plan.tokens,
                             causal=True)
        lengths = [plan.chunk_tokens(c) for c in plan.chunks]
        ranks = launch(causal_rank, STAGES, args=(shape, lengths, runs), timeout=1800)
        measured = measure(plan, inputs, runs)
        results[name] = (step_time(slow, STAGES), combined(measured, plan),
                         max(seconds for seconds, _ in ranks))
        predicted, in_process, distributed = (1e3 * t for t in results[name])
        print(f"  {name:>8} {lengths}: predicted {predicted:7.1f} ms  in process "
              f"{in_process:7.1f} ms  2 ranks {distributed:7.1f} ms")
        ratios = predict(plan, rates)
        print("           stage 0 predicted/measured per chunk: "
              + " ".join(f"{ratios[0, c.index] / measured[0, c.index]:.2f}" for c in plan.chunks))
    ratios = [u / t for u, t in zip(results["uniform"], results["terapipe"], strict=True)]
    print(f"  uniform / terapipe: predicted {ratios[0]:.2f}x  in process {ratios[1]:.2f}x  "
          f"2 ranks {ratios[2]:.2f}x")


def causal_auto(shape: dict, runs: int) -> None:
    """chunks="auto" as a user runs it: TeraPipe's slicing with the count chosen too."""
    ranks = launch(causal_rank, STAGES, args=(shape, "auto", runs), timeout=1800)
    seconds, lengths = max(ranks)
    print(f'  chunks="auto": {len(lengths)} chunks {lengths}: 2 ranks {seconds * 1e3:7.1f} ms')


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="small models, to check the script runs: their chunks take "
                             "microseconds, where per-op overhead and timer noise dominate, "
                             "so their errors are not comparable to the full run's")
    parser.add_argument("--runs", type=positive_int, default=5,
                        help="measurements each median is taken over")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[3, 4],
                        help="chunk counts of (b)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    torch.set_num_threads(1)
    rates = calibrate.load_or_measure("cpu", threads=1)
    if args.quick:
        print("--quick: small models; their errors are not comparable to the full run's")
    gm, inputs = dit(DIT_QUICK if args.quick else DIT_FULL)
    stage_accuracy(gm, inputs, rates, args.runs)
    for chunks in args.chunks:
        causal_slicing(LM_QUICK if args.quick else LM_FULL, rates, args.runs, chunks)
    causal_auto(LM_QUICK if args.quick else LM_FULL, args.runs)
    auto_vs_fixed(gm, rates)


if __name__ == "__main__":
    main()
