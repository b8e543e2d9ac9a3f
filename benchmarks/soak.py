"""Long runs on two gloo ranks: memory must not grow with the step or generation count.

    python benchmarks/soak.py [--ring-steps 25 50 100 200] [--generations 100]

1. Ring mode: one Ring run after another with more and more steps, in the same two
   processes; each rank's peak resident memory (max RSS) after each run, and the sends
   still held. Flat: the peak after the longest run within 5% of the peak after the first.
2. Per-call mode: --generations generations of 3 steps in a row through one compiled
   model (each generation starts by itself when the timestep rises); each rank's peak
   RSS every tenth of the way.
3. No process of the run is left once it returns: no child of this process, and no rank
   forked from the warm forkserver `launch` keeps (the server itself serves later launches
   and ends with this process, as multiprocessing's resource tracker does).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests, benchmarks: in ranks too

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
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


def live_processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every live process, zombies left out."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        if fields[0] != "Z":
            found.append((int(pid), int(fields[1]), command))
    return found


def leftover_processes() -> list[str]:
    """Command lines of live processes this one started and left: its children, and the
    forkserver's children (forked ranks). Left out: multiprocessing's resource tracker and
    the forkserver, one each per launching process, shared by every launch."""
    me, live = os.getpid(), live_processes()
    servers = {pid for pid, parent, command in live
               if parent == me and "multiprocessing.forkserver" in command}
    return [f"{pid}: {command[:120]}" for pid, parent, command in live
            if parent in servers or (parent == me and pid not in servers
                                     and "resource_tracker" not in command)]


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--ring-steps", type=positive_int, nargs="+", default=[25, 50, 100, 200],
                        help="steps of each ring run, one run after another")
    parser.add_argument("--generations", type=positive_int, default=100,
                        help="per-call generations of 3 steps")
    return parser


def main() -> None:
    args = arguments().parse_args()
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
    left = leftover_processes() + [str(p.pid) for p in multiprocessing.active_children()]
    print(f"processes left after the run: {len(left)}", *left, sep="\n  ")


if __name__ == "__main__":
    main()
