"""Long runs on two gloo ranks: memory must not grow with the step or generation count.

    python benchmarks/soak.py [--ring-steps 25 50 100 200] [--generations 100]

1. Ring mode: one Ring run after another with more and more steps, in the same two
   processes; each rank's peak resident memory (max RSS) after each run, and the sends
   still held. Flat: the peak after the longest run within 5% of the peak after the first.
2. Per-call mode: --generations generations of 3 steps in a row through one compiled
   model (each generation starts by itself when the timestep rises); each rank's peak
   RSS every tenth of the way.
3. No process of the run is left once it returns.
A tiny DiT with eager stages keeps it to a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, in every rank

import tokpipe_compiler as tp
from tokpipe_compiler.runtime.launch import launch

OPTIONS = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def model_and_step():
    from tests.fixtures.models import TinyDiT, dit_inputs

    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=64, heads=2, grid=16).eval()
    latents, _, labels = dit_inputs(model, 16)

    def step(latents, timestep, labels):
        return (latents - 0.05 * model(latents, timestep[None], labels),)

    return model, step, latents, labels


def soak_rank(rank: int, world: int, ring_steps: list[int], generations: int) -> dict:
    torch.set_num_threads(1)
    model, step, latents, labels = model_and_step()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    ring_rows = []
    for steps in ring_steps:
        timesteps = torch.linspace(999, 1, steps).long()
        ring.run({"latents": latents, "labels": labels}, per_step={"timestep": timesteps})
        pending = getattr(ring.program.transport, "pending_sends", None)
        ring_rows.append((steps, peak_mb(), pending))
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS), dynamic=False)
    gen_rows = []
    with torch.no_grad():
        for g in range(generations):
            x = latents
            for t in (900, 500, 100):
                x = x - 0.05 * compiled(x, torch.tensor([t]), labels)
            if (g + 1) % max(1, generations // 10) == 0:
                gen_rows.append((g + 1, peak_mb()))
    return {"ring": ring_rows, "generations": gen_rows}


def leftover_children() -> list[str]:
    """Command lines of live processes whose parent is this one, multiprocessing's own
    resource tracker (one per parent, shared by every spawn) left out."""
    me, children = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and "resource_tracker" not in command:
            children.append(f"{pid}: {command[:120]}")
    return children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ring-steps", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--generations", type=int, default=100)
    args = parser.parse_args()
    results = launch(soak_rank, 2, args=(args.ring_steps, args.generations), timeout=3600)
    print("ring mode: peak RSS (MB) per rank after each run, sends still held")
    for i, steps in enumerate(args.ring_steps):
        cells = "  ".join(f"rank {r}: {res['ring'][i][1]:7.1f} MB ({res['ring'][i][2]} held)"
                          for r, res in enumerate(results))
        print(f"  {steps:>4} steps  {cells}")
    print(f"per-call mode: peak RSS (MB) per rank over {args.generations} generations of 3 "
          "steps")
    for i, (count, _) in enumerate(results[0]["generations"]):
        cells = "  ".join(f"rank {r}: {res['generations'][i][1]:7.1f} MB"
                          for r, res in enumerate(results))
        print(f"  {count:>4} generations  {cells}")
    for r, res in enumerate(results):
        first, last = res["ring"][0][1], res["ring"][-1][1]
        gen_first, gen_last = res["generations"][0][1], res["generations"][-1][1]
        print(f"rank {r}: ring peak grew {100 * (last / first - 1):+.1f}% from "
              f"{args.ring_steps[0]} to {args.ring_steps[-1]} steps; generations "
              f"{100 * (gen_last / gen_first - 1):+.1f}% from the first tenth to the end")
    left = leftover_children() + [str(p.pid) for p in multiprocessing.active_children()]
    print(f"processes left after the run: {len(left)}", *left, sep="\n  ")


if __name__ == "__main__":
    main()
