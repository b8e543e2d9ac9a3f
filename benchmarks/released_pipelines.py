"""Released models in their diffusers pipelines on two ranks: serial against the ring, side
by side in one run per model.

    python benchmarks/released_pipelines.py [--names sd3-medium ...] [--steps 8]
        [--compiler eager] [--chunks 2] [--mode stale]

Each model is `tokpipe generate --released NAME --ranks 2 --compare` (released widths and
text length, random weights, guided, no text encoder or VAE): its transformer with
`--layers` blocks of each kind at a latent grid of about 1024 image tokens. Rank 0 first
runs the serial pipeline on one thread while the other rank waits, then both run the
pipelined one after a short call that traces and compiles it. Prints the
serial and pipelined seconds, the speedup and the largest difference of the latents
(relative; stale mode differs by design).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

from benchmarks._args import chunk_count, one_of, parser_for, positive_float, positive_int
from tokpipe_compiler import generate, released
from tokpipe_compiler.cli import _parser
from tokpipe_compiler.config import COMPILERS, MODES
from tokpipe_compiler.released.pipelines import small_grid
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

# About 1024 image tokens each: patch 2 over 64 x 64 latents (Flux: 2x2 packing); Wan's
# (1, 2, 2) patches over 4 x 32 x 32.
GRIDS = {"pixart-sigma-xl-2-1024-ms": (64, 64), "sd3-medium": (64, 64),
         "flux1-schnell": (64, 64), "wan2.1-t2v-1.3b": (4, 32, 32), "sana-1600m-1024px": (32, 32)}
LAYERS = {"flux1-schnell": 1}  # a double and a single block: 0.5B parameters


def measure(name: str, args: argparse.Namespace) -> dict:
    grid = GRIDS.get(name, small_grid(name))
    argv = ["generate", "--released", name, "--layers", str(LAYERS.get(name, args.layers)),
            "--grid", *map(str, grid), "--steps", str(args.steps), "--chunks", str(args.chunks),
            "--mode", args.mode, "--compiler", args.compiler, "--compare", "--device", "cpu",
            "--quiet"]  # rank 0's bars would split the table (TQDM_DISABLE does not reach them)
    options = _parser().parse_args(argv)
    start = time.perf_counter()
    results = launch(generate.run, 2, args=(options,), timeout=args.timeout)
    return {"name": name, "grid": grid, "wall_s": time.perf_counter() - start, **results[0]}


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--names", nargs="+", type=one_of(released.NAMES, "released config"),
                        default=list(GRIDS), metavar="NAME",
                        help=f"released models, of {', '.join(released.NAMES)}")
    parser.add_argument("--steps", type=positive_int, default=8, help="steps a generation")
    parser.add_argument("--layers", type=positive_int, default=2,
                        help="blocks of each kind (FLUX.1-schnell: 1)")
    parser.add_argument("--chunks", type=chunk_count, default=2,
                        help="chunks a stage (2 stages), or auto")
    parser.add_argument("--mode", default="stale", choices=MODES, help="the pipelined mode")
    parser.add_argument("--compiler", default="eager", choices=COMPILERS,
                        help="how tokpipe compiles its stages")
    parser.add_argument("--timeout", type=positive_float, default=1800.0,
                        help="seconds a model's two ranks may take")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    say_if_busy()  # the ranks' speedups need the cores to themselves
    title = (f"{args.steps} steps, 2 stages x {args.chunks} chunks, {args.mode}, "
             f"{args.compiler} stages, one thread a rank")
    print(title, flush=True)
    results = []
    for name in args.names:  # rank 0 says what it runs; each result is printed once known
        r = measure(name, args)
        results.append(r)
        print(f"{name}: serial {r['serial_s']:.2f} s, ring {r['pipelined_s']:.2f} s, "
              f"{r['serial_s'] / r['pipelined_s']:.2f}x, difference {r['difference']:.1e}",
              flush=True)
    print(f"\n{title}")  # the table at the end, where no rank's line comes between its rows
    print(f"{'model':<28}{'grid':>12}{'chunks':>8}{'serial s':>10}{'ring s':>9}{'speedup':>9}"
          f"{'difference':>12}")
    print(*map(row, results), sep="\n")
    print("chunks: the count each ring program has (* the timed call made a program)")


def row(r: dict) -> str:
    chunks = "/".join(map(str, r["chunks"])) + ("*" if r["made_while_timed"] else "")
    return (f"{r['name']:<28}{' x '.join(map(str, r['grid'])):>12}{chunks:>8}"
            f"{r['serial_s']:>10.2f}{r['pipelined_s']:>9.2f}"
            f"{r['serial_s'] / r['pipelined_s']:>8.2f}x{r['difference']:>12.1e}")


if __name__ == "__main__":
    main()
