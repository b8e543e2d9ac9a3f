"""What computing joint attention's text once a step changes in the generated latents.

    python benchmarks/text_fidelity.py [flux sd3 hunyuan_video ...] [--steps 8] [--chunks 4]

Each pipeline (the small fixtures of `tests/fixtures/pipelines.py` and `conditioned.py`,
random weights) generates its latents serially, then through `parallelize` in stale mode
(2 stages x `chunks` chunks, eager stage graphs, the ring) with `text_chunks="every"` (a
copy of the text stream per chunk) and `"first"` (the first chunk's, once a step). Prints
each one's relative max difference from serial, and theirs from each other. A fixture with
fewer grid rows than `chunks` runs with 2 chunks.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, benchmarks._args

from benchmarks._args import one_of, parser_for, positive_int
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.pipelines import FAMILIES, generate
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines import parallelize

BUILDERS = {**FAMILIES, **CONDITIONED}
DEFAULT = ["flux", "sd3", "hunyuan_video", "flux_kontext", "cogvideox", "auraflow"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def staled(name: str, text_chunks: str, chunks: int, steps: int) -> tuple[torch.Tensor, int]:
    """The stale ring's latents, and the chunk count it ran with."""
    for count in (chunks, 2):
        pipe, kwargs = BUILDERS[name]()
        try:
            parallelize(pipe, stages=2, chunks=count, compiler="eager", mode="stale",
                        text_chunks=text_chunks)
            return generate(pipe, kwargs, steps), count
        except Exception as err:  # Dynamo may wrap the backend's TokpipeError
            if "rows of the token grid" not in str(err):
                raise
    raise TokpipeError(f"{name}: fewer than 2 grid rows")


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("pipelines", nargs="*", type=one_of(sorted(BUILDERS), "pipeline"),
                        default=DEFAULT, metavar="PIPELINE",
                        help=f"of {', '.join(sorted(BUILDERS))}")
    parser.add_argument("--steps", type=positive_int, default=8, help="steps a generation")
    parser.add_argument("--chunks", type=positive_int, default=4,
                        help="chunks (2 for a fixture with fewer grid rows)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    warnings.filterwarnings("ignore")
    print(f"stale, 2 stages, {args.steps} steps; relative max difference of the latents")
    print(f"{'pipeline':<16} {'chunks':>6} {'every vs serial':>16} {'first vs serial':>16} "
          f"{'first vs every':>15}")
    for name in args.pipelines:
        serial = generate(*BUILDERS[name](), args.steps)
        every, chunks = staled(name, "every", args.chunks, args.steps)
        first, _ = staled(name, "first", args.chunks, args.steps)
        print(f"{name:<16} {chunks:>6} {relative(every, serial):>16.2e} "
              f"{relative(first, serial):>16.2e} {relative(first, every):>15.2e}", flush=True)


if __name__ == "__main__":
    main()
