"""How long `launch` takes to start ranks: spawned against forked from the warm server.

    python benchmarks/rank_start.py [--ranks 2] [--launches 5] [--diffusers]

Each launch runs a function that returns at once (`--diffusers`: one that builds a small
diffusers transformer, as the pipeline ranks do), so its wall time is the ranks' start and
teardown. The first forked launch also starts the server; it is reported apart. Both ways
alternate launch by launch, so drift in the machine's speed falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._args import parser_for, positive_int
from tokpipe_compiler.runtime.launch import launch


def returns(rank: int, world: int) -> int:
    return rank


def builds_a_transformer(rank: int, world: int) -> int:
    import diffusers

    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8,
                                            in_channels=4, num_layers=1, sample_size=8)
    return sum(p.numel() for p in model.parameters())


def timed(fn, ranks: int, start: str) -> float:
    begin = time.perf_counter()
    launch(fn, ranks, start=start, timeout=300)
    return time.perf_counter() - begin


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--ranks", type=positive_int, default=2, help="ranks a launch")
    parser.add_argument("--launches", type=positive_int, default=5,
                        help="timed launches each way (the median)")
    parser.add_argument("--diffusers", action="store_true",
                        help="ranks build a diffusers model (the launcher imports diffusers)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    fn = returns
    if args.diffusers:
        import diffusers  # noqa: F401  (the server then preloads diffusers' models)

        fn = builds_a_transformer
    first = timed(fn, args.ranks, "auto")
    spawned, forked = [], []
    for _ in range(args.launches):
        spawned.append(timed(fn, args.ranks, "spawn"))
        forked.append(timed(fn, args.ranks, "auto"))
    spawn_s, fork_s = statistics.median(spawned), statistics.median(forked)
    print(f"{args.ranks} ranks, {fn.__name__}, median of {args.launches} launches each")
    print(f"  spawned:                    {spawn_s:6.2f} s")
    print(f"  forked from the server:     {fork_s:6.2f} s  ({spawn_s / fork_s:.0f}x faster)")
    print(f"  first forked (starts it):   {first:6.2f} s")


if __name__ == "__main__":
    main()
