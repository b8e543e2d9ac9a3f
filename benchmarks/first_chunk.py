"""A ring whose first chunk computes joint attention's text: even tables against a lighter
first chunk, on two gloo ranks.

    python benchmarks/first_chunk.py [--text 512] [--side 64] [--chunks 2 4] [--steps 8]
        [--double 2] [--single 4] [--heads 4]

With text_chunks="first" (the default) each step's first chunk computes the text stream on
top of its image rows, so an even table is uneven in time: at FLUX.1's 512 text tokens and
1024 image tokens (512 px), 2 chunks are 1024 and 512 tokens. A ring of 2 stages then
waits on the first chunk each step; a first chunk with fewer image rows (as
`chunk_choice.lighter_first` sizes it from the plan's costs at this CPU's calibrated rates)
evens the chunks out. chunks="auto" tries both for every count.

The model is the Flux structure of `benchmarks/text_chunks.py` (2 double + 4 single blocks,
4 heads x 128, released text length) in a ring of FlowMatch Euler steps. Competitors, in
one run: the serial loop (one process, one thread), then each table as a ring on 2 ranks of
one thread (stale, 1 warmup step, eager stages); the serial loop's time is the median of
--rounds too. The rings are built in the same two
processes, each warmed by a short ring that plans and runs every chunk length, then timed
in interleaved rounds (median of --rounds). Prints seconds, speedup over serial, the table,
and the largest difference of each ring's latents from the first ring's (the tables cut the
stale K/V differently, so the difference is the stale approximation's, not zero).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.text_chunks

import tokpipe_compiler as tp
from benchmarks._args import at_least, parser_for, positive_int
from benchmarks.text_chunks import CHANNELS, POOLED, T5, flux
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.costmodel.chunk_choice import lighter_first
from tokpipe_compiler.pipelines.schedulers import step_table, update
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

RANKS, WARMUP = 2, 1


def build(args: argparse.Namespace):
    """The step function, its fixed inputs and per-step table: the same in every process."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = flux(args.double, args.single, args.heads)
    gen = torch.Generator().manual_seed(1)
    grid = args.side // 2
    ids = torch.zeros(grid, grid, 3)
    ids[..., 1] += torch.arange(grid)[:, None]
    ids[..., 2] += torch.arange(grid)[None, :]
    fixed = {"latents": torch.randn(1, grid * grid, CHANNELS, generator=gen),
             "text": torch.randn(1, args.text, T5, generator=gen),
             "pooled": torch.randn(1, POOLED, generator=gen),
             "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(args.text, 3)}
    table = step_table(FlowMatchEulerDiscreteScheduler(), args.steps)

    def denoise(latents, timestep, coeffs, text, pooled, img_ids, txt_ids):
        out = model(hidden_states=latents, encoder_hidden_states=text,
                    pooled_projections=pooled, timestep=timestep[None] / 1000,
                    guidance=torch.full((1,), 3.5), img_ids=img_ids, txt_ids=txt_ids,
                    return_dict=False)[0]
        return update(latents, out, None, coeffs)

    per_step = {"timestep": table.timesteps, "coeffs": table.coeffs}
    return model, denoise, fixed, per_step


def serial(args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    torch.set_num_threads(1)
    _, denoise, fixed, per_step = build(args)
    inputs = {k: v for k, v in fixed.items() if k != "latents"}
    with torch.no_grad():
        x, start = fixed["latents"], time.perf_counter()
        for k in range(args.steps):
            x, _ = denoise(x, per_step["timestep"][k], per_step["coeffs"][k], **inputs)
    return time.perf_counter() - start, x


def lighter_tokens(args: argparse.Namespace, chunks: int) -> list[int]:
    """Token lengths of `chunks` chunks whose first is sized by the plan's costs."""
    model, _, fixed, _ = build(args)
    kwargs = {"hidden_states": fixed["latents"], "encoder_hidden_states": fixed["text"],
              "pooled_projections": fixed["pooled"], "timestep": torch.tensor([0.5]),
              "guidance": torch.tensor([3.5]), "img_ids": fixed["img_ids"],
              "txt_ids": fixed["txt_ids"], "return_dict": False}
    plan = tp.explain(model, (), kwargs, stages=RANKS, chunks=chunks, compiler="eager")
    rates = calibrate.load_or_measure("cpu", 1)
    times = [calibrate.time_fn(s.cost, rates) for s in plan.stages]
    per_unit = plan.tokens // plan.units
    return [c.units * per_unit for c in lighter_first(plan.units, chunks, plan.tokens, times)]


def ring_rank(rank: int, world: int, args: argparse.Namespace, tables: list) -> list[dict]:
    """Each table's ring, built and warmed in these processes, then timed in interleaved
    rounds (every table once a round), so that drift in the machine's speed falls on all."""
    torch.set_num_threads(1)
    _, denoise, fixed, per_step = build(args)
    rings = [tp.Ring(denoise, carry=["latents"], stages=world, chunks=chunks, mode="stale",
                     warmup_steps=WARMUP, compiler="eager", timeout=1800.0)
             for chunks in tables]
    for ring in rings:
        ring.run(fixed, per_step=per_step, steps=WARMUP + 2)  # plans every chunk form
    times: list[list[float]] = [[] for _ in rings]
    outs: list[torch.Tensor] = []
    for _ in range(args.rounds):
        outs = []
        for ring, spent in zip(rings, times, strict=True):
            dist.barrier()
            start = time.perf_counter()
            outs.append(ring.run(fixed, per_step=per_step)[0])
            spent.append(time.perf_counter() - start)
    return [{"seconds": statistics.median(spent), "latents": out,
             "units": [c.units for c in ring.program.plan.chunks]}
            for ring, spent, out in zip(rings, times, outs, strict=True)]


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--text", type=positive_int, default=512, help="text tokens")
    parser.add_argument("--side", type=positive_int, default=64,
                        help="latent grid side (image tokens: (side / 2)^2)")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[2, 4],
                        help="chunk counts, each with an even and a lighter-first table")
    parser.add_argument("--steps", type=at_least(WARMUP + 1), default=8,
                        help=f"FlowMatch Euler steps, {WARMUP} of them warmup")
    parser.add_argument("--double", type=positive_int, default=2, help="double-stream blocks")
    parser.add_argument("--single", type=positive_int, default=4, help="single-stream blocks")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads of 128")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed rings per table")
    return parser


def main() -> None:
    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    torch.set_num_threads(1)
    base = statistics.median(serial(args)[0] for _ in range(args.rounds))
    rows: list[tuple[str, float, str, float | None]] = [("serial", base, "", None)]
    tables = [(f"2 x {m}, {name}", chunks) for m in args.chunks
              for name, chunks in (("even", m), ("lighter first", lighter_tokens(args, m)))]
    tables.append(("chunks='auto'", "auto"))
    print(f"{len(tables)} rings on {RANKS} ranks, {args.rounds} rounds...", file=sys.stderr)
    results = launch(ring_rank, RANKS, (args, [chunks for _, chunks in tables]),
                     timeout=3600.0)[0]
    first = results[0]["latents"]
    for (name, _), result in zip(tables, results, strict=True):
        diff = ((result["latents"] - first).abs().max() / first.abs().max()).item()
        rows.append((f"ring {name}", result["seconds"], str(result["units"]),
                     diff if result is not results[0] else None))
    print(f"\nFlux structure, {args.double} double + {args.single} single blocks, "
          f"{args.heads} heads x 128, {args.text} text + {(args.side // 2) ** 2} image "
          f"tokens, {args.steps} FlowMatch Euler steps, stale, 1 warmup step; "
          f"2 gloo ranks x 1 thread, eager stages")
    print(f"{'run':<26} {'seconds':>8} {'vs serial':>10} {'grid units per chunk':>22} "
          f"{'vs first':>9}")
    for name, seconds, units, diff in rows:
        shown = "" if diff is None else f"{diff:.1e}"
        print(f"{name:<26} {seconds:>8.2f} {base / seconds:>9.2f}x {units:>22} {shown:>9}")


if __name__ == "__main__":
    main()
