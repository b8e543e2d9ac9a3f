"""A released-width transformer through the in-process pipeline, against serial eager and
serial Inductor, on one device.

    python benchmarks/gpu_pipeline.py [--model pixart-alpha-xl-2-1024-ms] [--layers 4]
        [--grid 128 128] [--chunks 2 4 8] [--stages 2] [--device cuda] [--dtype bfloat16]
        [--cuda-graphs] [--attention sdpa triton] [--timesteps views fresh] [--queued]
        [--profile]

The model is the family's diffusers class at its released widths and text length (the
config in tokpipe_compiler/released/configs/), with --layers blocks and random weights,
called as its pipeline calls it with guidance (batch 2), each step's timestep an element of
a schedule on the device expanded over the batch. One device runs every stage in turn, so the
pipelined step cannot beat the serial one: the ratio shows what chunking and the runtime
cost at this size (a pipeline of S devices can at best reach S / ratio). Each tokpipe row
is stale mode, warmup 1, stages compiled with Inductor; it also prints how far the
warmup (exact) step is from eager, relative to the output's norm. With --cuda-graphs every
chunk count runs twice, without and with the `cuda_graphs` option, and the graphed row
says how far its last step is from the same step without graphs. With two --attention
kernels every tokpipe row runs with each (the `attention` option). With `--timesteps views
fresh` every tokpipe row also runs with each call's timestep a fresh tensor on the device
(not a view of a schedule), which the runtime can only read by waiting for the device: the
difference is what reading timesteps from a host copy of the schedule saves. The two are
timed in alternating rounds on one compiled program. Each step is timed between two waits
for the device (the median of the steps after the first), or with --queued the steps after
the first as one run (their mean), as a pipeline's loop queues them: only then can what the
runtime does without waiting for the device overlap the device's work. With --profile each
compiled row is also run under the profiler and its note gives the GPU's busy time a step
(the kernels' own time; the rest of a step the GPU waits for the host).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokpipe_compiler as tp
from benchmarks._args import at_least, chunk_count, parser_for, positive_int
from tokpipe_compiler import released


def to_device(value: Any, device: str, dtype: torch.dtype) -> Any:
    """Inputs on `device`, floating tensors in `dtype`; nested dicts too."""
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype if value.is_floating_point() else value.dtype)
    return value


def timesteps(inputs: dict, steps: int, fresh: bool = False) -> list[torch.Tensor]:
    """Each call's timestep, as a pipeline passes it: an element of a falling schedule on
    the device, expanded over the batch (each call the next step of one generation);
    `fresh`: each a tensor of its own on the device instead."""
    like = inputs["timestep"]
    values = [999.0 - 40.0 * k for k in range(steps)]
    if fresh:
        return [torch.full(like.shape, v, dtype=like.dtype, device=like.device)
                for v in values]
    schedule = torch.tensor(values, dtype=like.dtype, device=like.device)
    return [t.expand(like.shape) for t in schedule]


class Clock(NamedTuple):
    """How steps are timed: `sync` waits for the device; `queued` times the steps after
    the first as one run with a wait only at its end (as a pipeline's loop runs), instead
    of each step between two waits."""

    sync: Callable[[], None]
    queued: bool = False


def run_steps(fn: Callable, inputs: dict, steps: int, clock: Clock, fresh: bool = False
              ) -> tuple[float, Any, Any]:
    """ms per step over `steps` calls with falling timesteps (fresh tensors with `fresh`),
    the first call not counted: the median of the steps, or their mean when queued; the
    first output and the last."""
    times, first, out = [], None, None
    start = 0.0
    for k, t in enumerate(timesteps(inputs, steps, fresh)):
        if not clock.queued or k <= 1:
            clock.sync()
            start = time.perf_counter()
        out = fn(**dict(inputs, timestep=t))
        if not clock.queued or k == 0:
            clock.sync()
            times.append(1e3 * (time.perf_counter() - start))
        first = out[0] if first is None else first
    if clock.queued:
        clock.sync()
        return 1e3 * (time.perf_counter() - start) / max(steps - 1, 1), first, out[0]
    return statistics.median(times[1:]), first, out[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--model", default="pixart-alpha-xl-2-1024-ms", choices=released.NAMES,
                        metavar="NAME", help=f"the released model, of {', '.join(released.NAMES)}")
    parser.add_argument("--layers", type=positive_int, default=4, help="blocks of each kind")
    parser.add_argument("--grid", type=positive_int, nargs="+", default=[128, 128],
                        help="the latent grid, H W or F H W")
    parser.add_argument("--chunks", type=chunk_count, nargs="+", default=[2, 4, 8],
                        help='chunk counts; "auto": chosen at the rates measured here')
    parser.add_argument("--stages", type=positive_int, default=2,
                        help="pipeline stages, all on the one device")
    parser.add_argument("--steps", type=at_least(2), default=6,
                        help="timed calls per competitor (the first is not counted)")
    parser.add_argument("--device", default="cuda", help="the torch device")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="the model's dtype")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                        help="how tokpipe compiles its stages")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="each chunk count also with the cuda_graphs option")
    parser.add_argument("--attention", nargs="+", default=["sdpa"], choices=["sdpa", "triton"],
                        help="the attention option; several: each tokpipe row with each")
    parser.add_argument("--timesteps", nargs="+", default=["views"], choices=["views", "fresh"],
                        help="each call's timestep: a view of a schedule on the device (as "
                             "pipelines pass it) or a fresh tensor; several: each tokpipe "
                             "row with each")
    parser.add_argument("--queued", action="store_true",
                        help="time each row's steps as one queued run (a wait for the device "
                             "only at its end), not each step between two waits")
    parser.add_argument("--profile", action="store_true",
                        help="the GPU's busy time a step of each compiled row")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if args.profile and not args.device.startswith("cuda"):
        parser.error("--profile times kernels on a CUDA device: pass --device cuda")
    dtype, grid = getattr(torch, args.dtype), tuple(args.grid)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = Clock(sync, args.queued)
    model = released.build(args.model, layers=args.layers, device=args.device, grid=grid)
    model = model.to(dtype)
    inputs = to_device(released.inputs(args.model, batch=2, grid=grid), args.device, dtype)
    tokens = _tokens(inputs, model)
    print(f"{args.model}: released widths, {args.layers} blocks, grid {grid} ({tokens} image "
          f"tokens), batch 2, {args.device} {args.dtype}", flush=True)
    rows: list[tuple[str, float, str]] = []
    with torch.no_grad():
        eager_ms, reference, _ = run_steps(model, inputs, args.steps, clock)
        rows.append(("serial eager", eager_ms, ""))
        print(f"serial eager: {eager_ms:.2f} ms/step", flush=True)
        start = time.perf_counter()
        inductor = torch.compile(model, dynamic=False)
        inductor(**inputs)
        compile_s = time.perf_counter() - start
        ms, out, _ = run_steps(inductor, inputs, args.steps, clock)
        rows.append(("serial inductor", ms, f"compile {compile_s:.0f} s, "
                                            f"vs eager {relative(out, reference):.1e}"
                                            f"{busy_note(inductor, inputs, args)}"))
        print(f"serial inductor: {ms:.2f} ms/step", flush=True)
        for chunks, kernel in itertools.product(args.chunks, args.attention):
            plain, last = pipelined(model, inputs, args, chunks, kernel, clock, reference)
            report(rows, plain)
            if args.cuda_graphs:
                graphed, last_graphed = pipelined(model, inputs, args, chunks, kernel, clock,
                                                  reference, True)
                note = f", last step vs no graphs {relative(last_graphed, last):.1e}"
                report(rows, [(label, ms, text + note) for label, ms, text in graphed])
    print(f"\n{'run':<54} {'ms/step':>9} {'vs eager':>9} {'vs inductor':>11}  notes")
    for label, ms, note in rows:
        print(f"{label:<54} {ms:>9.2f} {eager_ms / ms:>8.2f}x {rows[1][1] / ms:>10.2f}x  {note}")


def report(rows: list, new_rows: list[tuple[str, float, str]]) -> None:
    rows.extend(new_rows)
    for label, ms, _ in new_rows:
        print(f"{label}: {ms:.2f} ms/step", flush=True)


def pipelined(model, inputs: dict, args, chunks: int | str, kernel: str, clock: Clock, reference,
              cuda_graphs: bool = False) -> tuple[list[tuple[str, float, str]], Any]:
    """A tokpipe row for each way of passing timesteps (timed in alternating rounds on one
    compiled program, so the host's drift falls on each), and the last step's output."""
    options = {"stages": args.stages, "chunks": chunks, "mode": "stale", "warmup_steps": 1,
               "compiler": args.compiler, "cuda_graphs": cuda_graphs, "attention": kernel}
    # Every row compiles the same forward: past Dynamo's recompile limit a row would run
    # the eager model unnoticed.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    start = time.perf_counter()
    run_steps(compiled, inputs, 3, clock)  # plans, compiles both chunk lengths (and captures)
    compile_s = time.perf_counter() - start
    rounds = 3 if len(args.timesteps) > 1 else 1
    times: dict[str, list[float]] = {kind: [] for kind in args.timesteps}
    for _, kind in itertools.product(range(rounds), args.timesteps):
        tp.reset(compiled)
        ms, warm, last = run_steps(compiled, inputs, args.steps + 1, clock, kind == "fresh")
        times[kind].append(ms)
    if chunks == "auto":  # the count the plan chose
        chunks = f"auto={len(tp.programs(compiled)[0].plan.chunks)}"
    note = f"plan+compile {compile_s:.0f} s, warmup vs eager {relative(warm, reference):.1e}"
    rows = []
    for kind, kind_times in times.items():
        label = (f"tokpipe {args.stages} stages x {chunks} chunks"
                 f"{f', {kernel}' if len(args.attention) > 1 else ''}"
                 f"{', fresh timesteps' if kind == 'fresh' else ''}"
                 f"{', graphs' if cuda_graphs else ''}")
        tp.reset(compiled)
        busy = busy_note(compiled, inputs, args, kind == "fresh")
        rows.append((label, statistics.median(kind_times), note + busy))
    tp.reset(compiled)
    return rows, last


def busy_note(fn: Callable, inputs: dict, args, fresh: bool = False) -> str:
    """', GPU busy X ms/step' over args.steps calls after a first (warmup) one: the union
    of the intervals in which the device ran a kernel or a copy, from the profiler's raw
    device events (a sum over its per-op table counts a kernel under its op and again on
    its own); '' without --profile."""
    if not args.profile:
        return ""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    active = max(args.steps - 1, 1)
    try:
        with profile(activities=[ProfilerActivity.CUDA],
                     schedule=schedule(wait=1, warmup=0, active=active)) as prof:
            for t in timesteps(inputs, active + 1, fresh):
                fn(**dict(inputs, timestep=t))
                prof.step()
        torch.cuda.synchronize()
        spans = [(e.start_ns(), e.start_ns() + e.duration_ns())
                 for e in prof.profiler.kineto_results.events()
                 if e.device_type() == DeviceType.CUDA]
    except Exception as e:  # the timing above stands without the profile
        return f", profile failed: {type(e).__name__}: {e}"
    return f", GPU busy {union_ns(spans) / 1e6 / active:.2f} ms/step"


def union_ns(spans: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def _tokens(inputs: dict, model) -> int:
    patch = model.config.get("patch_size") or 1
    shape = inputs["hidden_states"].shape
    return shape[-1] * shape[-2] // patch**2


if __name__ == "__main__":
    main()
