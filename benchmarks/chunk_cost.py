"""Each chunk's measured seconds on each stage against the cost model's, with and without
joint attention's text.

    python benchmarks/chunk_cost.py [--stages 1 2] [--chunks 2 4] [--calls 7]
        [--text 512] [--side 64] [--double 2] [--single 4] [--heads 4]

The Flux structure of `benchmarks/text_chunks.py` (released text length, fewer and narrower
blocks), stale mode, eager stage graphs, every stage in this one process on one thread, so
a chunk's time is its own work and nothing else's. With `text_chunks="first"` a step's first
chunk computes the text stream and the others do not: the pair of rows per stage shows
whether the cost model prices the text as the CPU runs it. Measured: the median of the
executor's compute events per (stage, chunk) over the chunked calls; predicted:
`calibrate.seconds` of the stage's Cost at this CPU's calibrated rates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.text_chunks

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from benchmarks.text_chunks import call_of, flux
from tokpipe_compiler.costmodel import calibrate


def rows(model: torch.nn.Module, stages: int, chunks: int, calls: int, text: int,
         side: int) -> list[str]:
    """One table row per (stage, chunk) of a `stages` x `chunks` plan of `model`."""
    backend = tp.backend(stages=stages, chunks=chunks, mode="stale", warmup_steps=1,
                         compiler="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    call = call_of(compiled, text, side, "cpu", torch.float32)
    with torch.no_grad():
        for _ in range(calls + 1):  # the warmup step, then the chunked ones
            call()
    (program,) = tp.programs(compiled)
    plan, rates = program.plan, calibrate.load_or_measure("cpu")
    events = [e for e in program.timeline.events if e.kind == "compute" and not e.whole]
    out = []
    for stage in plan.stages:
        for chunk in plan.chunks:
            measured = statistics.median(e.duration for e in events
                                         if e.stage == stage.index and e.chunk == chunk.index)
            predicted = calibrate.seconds(stage.cost, rates, plan.chunk_tokens(chunk),
                                          plan.tokens, float(chunk.segments))
            out.append(f"| {stages} x {chunks} | {stage.index} | {chunk.index} | "
                       f"{plan.chunk_tokens(chunk)} | {'yes' if chunk.segments else 'no'} | "
                       f"{measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
                       f"{measured / predicted:.2f} |")
    torch._dynamo.reset()
    return out


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--stages", type=positive_int, nargs="+", default=[1, 2],
                        help="stage counts, each a plan")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[2, 4],
                        help="chunk counts, each a plan")
    parser.add_argument("--calls", type=positive_int, default=7, help="chunked calls measured")
    parser.add_argument("--text", type=positive_int, default=512, help="text tokens")
    parser.add_argument("--side", type=positive_int, default=64,
                        help="latent grid side (image tokens: (side / 2)^2)")
    parser.add_argument("--double", type=positive_int, default=2, help="double-stream blocks")
    parser.add_argument("--single", type=positive_int, default=4, help="single-stream blocks")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads of 128")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    model = flux(args.double, args.single, args.heads)
    print("| plan | stage | chunk | image tokens | text | measured ms | predicted ms | ratio |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for stages in args.stages:
        for chunks in args.chunks:
            print("\n".join(rows(model, stages, chunks, args.calls, args.text, args.side)),
                  flush=True)


if __name__ == "__main__":
    main()
