"""Host time a step costs beyond the model's own ops: the runtime and the per-call prelude.

    python benchmarks/host_overhead.py [--layers 28] [--chunks 1 2 4] [--stages 2]
        [--compiler inductor] [--reps 30]

On a GPU a DiT step at released depth is bound by the host: launching its kernels, and
whatever the runtime does around them. Here the same situation is made on the CPU: a
PixArt-alpha structure at full depth (28 blocks, cross-attention to text, per-block
modulation) with tiny widths (2 heads of 8, 64 image tokens, batch 2 for guidance), so
that the arithmetic is negligible and every step time is host time.

One process, one thread. Runs serial eager, serial Inductor (`torch.compile` default) and
tokpipe with S stages x M chunks in stale mode (all stages in this process, so the same
work as serial), and splits a tokpipe step into:
  stages   inside the stage functions (the compiled code, per chunk pass)
  prelude  the per-call prelude (conditioning shared by every chunk, once per step)
  runtime  everything else: Dynamo's guards, the executor (inputs per chunk, schedule,
           assembling the output), step bookkeeping
A chunk pass of L/S blocks runs the ops of L/S blocks, so the stage time grows with M; on
a GPU, CUDA graphs (the `cuda_graphs` option) replay a chunk's launches at once. The
prelude and runtime columns are what stays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int

HEADS, HEAD_DIM, SIDE, TEXT, BATCH = 2, 8, 16, 8, 2


def pixart(layers: int) -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    return PixArtTransformer2DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
        out_channels=8, num_layers=layers, sample_size=SIDE, patch_size=2,
        cross_attention_dim=HEADS * HEAD_DIM, caption_channels=32,
        norm_type="ada_norm_single", use_additional_conditions=False).eval()


def call_of(model: torch.nn.Module) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, 4, SIDE, SIDE, generator=gen)
    kwargs = {"encoder_hidden_states": torch.randn(BATCH, TEXT, 32, generator=gen),
              "timestep": torch.full((BATCH,), 500.0),
              "encoder_attention_mask": torch.ones(BATCH, TEXT),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    return lambda: model(latents, **kwargs)


def interleaved_ms(calls: dict[str, Callable[[], object]], rounds: int, reps: int
                   ) -> dict[str, list[float]]:
    """Step times of each call, measured in `rounds` rounds of `reps` steps that take the
    calls in turn, so that drift in the machine's speed falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(reps):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    return {name: [1e3 * x for x in t] for name, t in times.items()}


class Clock:
    """Wraps callables to add up the time spent inside them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def tokpipe_call(model: torch.nn.Module, stages: int, chunks: int, compiler: str
                 ) -> tuple[Callable[[], object], Clock, Clock]:
    """A stepping tokpipe model, and clocks on its stage functions and its prelude."""
    options = {"stages": stages, "chunks": chunks, "mode": "stale", "warmup_steps": 1,
               "compiler": compiler}
    backend = tp.backend(**options)
    call = call_of(torch.compile(model, backend=backend, dynamic=False))
    for _ in range(3):  # warmup step, then chunked steps: every chunk length compiled
        call()
    stage_clock, prelude_clock = Clock(), Clock()
    for program in tp.programs(backend):  # this backend's, not the same model's others
        for stage in program.stage_programs:
            stage.compiled = {n: stage_clock.wrap(fn) for n, fn in stage.compiled.items()}
        program.prelude = prelude_clock.wrap(program.prelude)
    return call, stage_clock, prelude_clock


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--layers", type=positive_int, default=28, help="PixArt-alpha blocks")
    parser.add_argument("--stages", type=positive_int, default=2, help="tokpipe stages S")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[1, 2, 4],
                        help="chunk counts M, each a tokpipe row")
    parser.add_argument("--compiler", default="inductor", choices=["eager", "inductor"],
                        help="how tokpipe compiles its stages")
    parser.add_argument("--rounds", type=positive_int, default=10,
                        help="interleaved timing rounds")
    parser.add_argument("--reps", type=positive_int, default=5, help="steps per call and round")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    model = pixart(args.layers)
    torch._dynamo.reset()
    with torch.no_grad():
        calls = {"serial eager": call_of(model),
                 "serial inductor": call_of(torch.compile(model, dynamic=False))}
        calls["serial inductor"]()
        clocks = {}
        for chunks in args.chunks:
            name = f"tokpipe {args.stages}x{chunks}"
            calls[name], *clocks[name] = tokpipe_call(model, args.stages, chunks,
                                                      args.compiler)
        steps = interleaved_ms(calls, args.rounds, args.reps)
    base = statistics.median(steps["serial inductor"])
    print(f"\nPixArt-alpha structure, {args.layers} blocks, {HEADS}x{HEAD_DIM} heads, "
          f"{(SIDE // 2) ** 2} tokens, batch {BATCH}; tokpipe stages compiled with "
          f"{args.compiler}; ms per step (median of {args.rounds} x {args.reps}, "
          "interleaved); stages/prelude/runtime: shares of the mean step")
    print(f"{'run':<16} {'step':>8} {'vs ind.':>8} | {'stages':>8} {'prelude':>8} "
          f"{'runtime':>8}")
    measured = args.rounds * args.reps
    for name, times in steps.items():
        step, parts = statistics.median(times), ""
        if name in clocks:
            stage_ms, prelude_ms = (1e3 * c.seconds / measured for c in clocks[name])
            runtime_ms = statistics.mean(times) - stage_ms - prelude_ms
            parts = f" {stage_ms:>8.2f} {prelude_ms:>8.2f} {runtime_ms:>8.2f}"
        print(f"{name:<16} {step:>8.2f} {step / base:>7.2f}x |{parts}")


if __name__ == "__main__":
    main()
