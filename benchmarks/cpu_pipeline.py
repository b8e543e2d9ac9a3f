"""Serial and pipelined DiT generation on this CPU, every competitor in one run.

    python benchmarks/cpu_pipeline.py [--steps 20] [--chunks 2 4 8 auto] [--quick]
        [--compiler inductor]

Model: DiT-S/2 sized DiTTransformer2DModel (12 layers, hidden 384, 6 heads, patch 2, 64x64
latent = 1024 tokens), seeded random weights, DDIM, 1 warmup step. Competitors: serial eager
on 1 and 2 threads, serial Inductor on 2 threads; tokpipe on 2 ranks of 1 thread, per-call
and ring mode, for each chunk count, its stages compiled by Inductor (or --compiler eager).
Compilation happens before timing, for every competitor. Prints each time, its speedup
over serial eager on 1 thread, the ideal speedup S / (W + (S-W)/N * (1 + (N-1)/(M*(S-W))))
and the ratio to it, and for ring mode where each rank's time went (compute, waiting on
receives, sending). Each row is printed as it finishes, the table once all have: the
defaults run for up to ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import at_least, chunk_count, parser_for
from tokpipe_compiler.pipelines.schedulers import step_table, update
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

FULL = {"layers": 12, "heads": 6, "head_dim": 64, "side": 64}
QUICK = {"layers": 4, "heads": 4, "head_dim": 32, "side": 32}
RANKS, WARMUP = 2, 1


def dit_model(shape: dict):
    """The benchmark DiT, seeded: the same weights in every process and script."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    return DiTTransformer2DModel(
        num_attention_heads=shape["heads"], attention_head_dim=shape["head_dim"],
        in_channels=4, out_channels=8, num_layers=shape["layers"], sample_size=shape["side"],
        patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero",
    ).eval()


def build(shape: dict, steps: int):
    from diffusers import DDIMScheduler

    model = dit_model(shape)
    table = step_table(DDIMScheduler(clip_sample=False), steps)
    side = shape["side"]
    latents = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(1))

    def denoise(latents, timestep, input_scale, coeffs, labels):
        out = model(latents * input_scale, timestep=timestep[None], class_labels=labels).sample
        return update(latents, out[:, :4], None, coeffs)

    per_step = {"timestep": table.timesteps, "input_scale": table.input_scale,
                "coeffs": table.coeffs}
    return denoise, {"latents": latents, "labels": torch.tensor([207])}, per_step


def step_inputs(per_step: dict, k: int) -> tuple:
    return tuple(per_step[n][k] for n in ("timestep", "input_scale", "coeffs"))


def serial(shape: dict, steps: int, threads: int, inductor: bool) -> float:
    torch.set_num_threads(threads)
    denoise, inputs, per_step = build(shape, steps)
    fn = torch.compile(denoise, dynamic=False) if inductor else denoise
    with torch.no_grad():
        if inductor:
            fn(inputs["latents"], *step_inputs(per_step, 0), inputs["labels"])  # compile
        x, start = inputs["latents"], time.perf_counter()
        for k in range(steps):
            x, _ = fn(x, *step_inputs(per_step, k), inputs["labels"])
    return time.perf_counter() - start


def pipelined(rank: int, world: int, shape: dict, steps: int, chunks: int, ring: bool,
              compiler: str) -> dict:
    denoise, inputs, per_step = build(shape, steps)
    options = {"stages": world, "chunks": chunks, "mode": "stale", "warmup_steps": WARMUP,
               "compiler": compiler, "timeout": 1800.0}
    if ring:
        runner = tp.Ring(denoise, carry=["latents"], **options)
        runner.run(inputs, per_step=per_step, steps=WARMUP + 1)  # plan every chunk length
        program = runner.program
        program.timeline.events.clear()
        dist.barrier()
        start = time.perf_counter()
        runner.run(inputs, per_step=per_step)
    else:
        compiled = torch.compile(denoise, backend=tp.backend(**options), dynamic=False)
        x = inputs["latents"]
        with torch.no_grad():
            for k in range(WARMUP + 1):
                x, _ = compiled(x, *step_inputs(per_step, k), inputs["labels"])
            tp.reset(compiled)
            dist.barrier()
            start, x = time.perf_counter(), inputs["latents"]
            for k in range(steps):
                x, _ = compiled(x, *step_inputs(per_step, k), inputs["labels"])
        program = None
    elapsed = time.perf_counter() - start
    if program is None:
        (program,) = tp.programs(compiled)
        breakdown_of = None
    else:
        breakdown_of = breakdown(program)
    return {"seconds": elapsed, "breakdown": breakdown_of, "chunks": len(program.plan.chunks)}


def breakdown(program) -> dict:
    totals = {"compute": 0.0, "recv": 0.0, "send": 0.0}
    for event in program.timeline.events:
        totals[event.kind] += event.duration
    computes = [e.duration for e in program.timeline.events if e.kind == "compute"]
    totals["per_chunk_ms"] = 1e3 * sorted(computes)[len(computes) // 2] if computes else 0.0
    return totals


def ideal(steps: int, ranks: int, chunks: int) -> float:
    rest = steps - WARMUP
    return steps / (WARMUP + rest / ranks * (1 + (ranks - 1) / (chunks * rest)))


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--steps", type=at_least(WARMUP + 1), default=20,
                        help=f"denoising steps, {WARMUP} of them warmup")
    parser.add_argument("--chunks", type=chunk_count, nargs="+", default=[2, 4, 8, "auto"],
                        help="chunk counts, or auto (the cost model chooses)")
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor",
                        help="how tokpipe compiles its stages (untimed: compiled before timing)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    shape = QUICK if args.quick else FULL
    print(f"model {shape}, {args.steps} steps, warmup {WARMUP}, {RANKS} ranks x 1 thread, "
          f"tokpipe stages: {args.compiler}", flush=True)
    rows: list[tuple[str, float, float | None, list | None]] = []
    for label, threads, inductor in (("serial eager, 1 thread", 1, False),
                                     ("serial eager, 2 threads", 2, False),
                                     ("serial inductor, 2 threads", 2, True)):
        finished(rows, (label, serial(shape, args.steps, threads, inductor), None, None))
    for chunks in args.chunks:
        for ring in (False, True):
            results = launch(pipelined, RANKS, timeout=3600,
                             args=(shape, args.steps, chunks, ring, args.compiler))
            seconds = max(r["seconds"] for r in results)
            label = f"tokpipe {'ring' if ring else 'per-call'}, chunks {chunks}"
            used = results[0]["chunks"]
            label += f" ({used})" if chunks == "auto" else ""
            finished(rows, (label, seconds, ideal(args.steps, RANKS, used),
                            [r["breakdown"] for r in results]))
    report(rows)


def finished(rows: list, row: tuple) -> None:
    """Keep a finished run's row and print it now: a run cut short still shows its rows."""
    rows.append(row)
    label, seconds = row[0], row[1]
    print(f"{label}: {seconds:.2f} s, {rows[0][1] / seconds:.2f}x over serial eager on 1 "
          "thread", flush=True)


def report(rows: list) -> None:
    base = rows[0][1]
    fastest_serial = min(r[1] for r in rows[:3])
    width = max(len(r[0]) for r in rows)  # "tokpipe per-call, chunks auto (8)" and longer
    print(f"\n{'run':<{width}} {'time s':>8} {'speedup':>8} {'vs best':>9} {'ideal':>6} "
          f"{'of ideal':>8}")
    for label, seconds, bound, _ in rows:  # speedup over serial eager 1 thread, and over
        speedup = base / seconds              # the fastest serial run ("vs best")
        extra = f"{bound:>6.2f} {speedup / bound:>8.0%}" if bound else ""
        print(f"{label:<{width}} {seconds:>8.2f} {speedup:>7.2f}x "
              f"{fastest_serial / seconds:>8.2f}x {extra}")
    print("\nwhere ring-mode time went, per rank (s): compute / waiting on receives / sending;"
          " median compute per chunk")
    for label, _, _, parts in rows:
        if parts and parts[0]:
            shown = "  ".join(f"r{i}: {p['compute']:.2f}/{p['recv']:.2f}/{p['send']:.3f} "
                              f"({p['per_chunk_ms']:.1f} ms)" for i, p in enumerate(parts))
            print(f"{label:<{width}} {shown}")


if __name__ == "__main__":
    main()
