"""Released models in their diffusers pipelines on two ranks: serial against the ring, side
by side in one run per model.

    python benchmarks/released_pipelines.py [--names sd3-medium ...] [--steps 8]
        [--compiler eager] [--chunks 2]

Each model is `tokpipe generate --released NAME --ranks 2 --compare` (released widths and
text length, random weights, guided, no text encoder or VAE): its transformer with
`--layers` blocks of each kind at a latent grid of about 1024 image tokens. Both ranks
first run the serial pipeline (one thread each, at once, so both cores are busy as in the
ring), then the pipelined one after a short call that traces and compiles it. Prints the
serial and pipelined seconds, the speedup and the largest difference of the latents
(relative; stale mode differs by design).
"""

from __future__ import annotations

import argparse
import time

from tokpipe_compiler.cli import _parser
from tokpipe_compiler.generate import run
from tokpipe_compiler.released.pipelines import small_grid
from tokpipe_compiler.runtime.launch import launch

# About 1024 image tokens each: patch 2 over 64 x 64 latents (Flux: 2x2 packing); Wan's
# (1, 2, 2) patches over 4 x 32 x 32.
GRIDS = {"pixart-sigma-xl-2-1024-ms": (64, 64), "sd3-medium": (64, 64),
         "flux1-schnell": (64, 64), "wan2.1-t2v-1.3b": (4, 32, 32), "sana-1600m-1024px": (32, 32)}
LAYERS = {"flux1-schnell": 1}  # a double and a single block: 0.5B parameters


def measure(name: str, args: argparse.Namespace) -> dict:
    grid = GRIDS.get(name, small_grid(name))
    argv = ["generate", "--released", name, "--layers", str(LAYERS.get(name, args.layers)),
            "--grid", *map(str, grid), "--steps", str(args.steps), "--chunks", args.chunks,
            "--mode", args.mode, "--compiler", args.compiler, "--compare", "--device", "cpu"]
    options = _parser().parse_args(argv)
    start = time.perf_counter()
    results = launch(run, 2, args=(options,), timeout=args.timeout)
    return {"name": name, "grid": grid, "wall_s": time.perf_counter() - start, **results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", nargs="+", default=list(GRIDS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunks", default="2")
    parser.add_argument("--mode", default="stale")
    parser.add_argument("--compiler", default="eager")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    print(f"{args.steps} steps, 2 stages x {args.chunks} chunks, {args.mode}, "
          f"{args.compiler} stages, one thread a rank")
    print(f"{'model':<28}{'grid':>12}{'chunks':>8}{'serial s':>10}{'ring s':>9}{'speedup':>9}"
          f"{'difference':>12}")
    for name in args.names:
        r = measure(name, args)
        chunks = "/".join(map(str, r["chunks"])) + ("*" if r["made_while_timed"] else "")
        print(f"{name:<28}{' x '.join(map(str, r['grid'])):>12}{chunks:>8}{r['serial_s']:>10.2f}"
              f"{r['pipelined_s']:>9.2f}{r['serial_s'] / r['pipelined_s']:>8.2f}x"
              f"{r['difference']:>12.1e}", flush=True)
    print("chunks: the count each ring program has (* the timed call made a program)")


if __name__ == "__main__":
    main()
