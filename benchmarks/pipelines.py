"""A guided diffusers pipeline end to end, every way of running it, side by side in one run.

    python benchmarks/pipelines.py [--steps 20] [--layers 6] [--chunks 2] [--compiler eager]

The pipeline: diffusers' DiTPipeline with a DiT-S/2 width transformer (hidden 384, 6 heads,
patch 2, 64x64 latent = 1024 tokens; --layers blocks), a small VAE, DDIM without
clipping, guidance scale 4 (the transformer runs a batch of 2 every step), seeded random
weights. Competitors, each timed after a first short call that traces and compiles it:

- serial: the pipeline as is, one process of one thread;
- per call: `parallelize(pipe, ring=False)` on 2 ranks: every step fills and drains;
- ring: `parallelize(pipe)` on 2 ranks: the loop as one ring;
- cfg: `parallelize(pipe, cfg=2, stages=1)` on 2 ranks: one guidance branch per rank;
- hybrid: `parallelize(pipe, cfg=2, stages=2)` on 4 ranks: a ring per guidance branch, run
  where the machine has a core per rank (or with --hybrid).

Each pipelined rank has one thread: on 2 cores, 2 ranks are the physical bound (2x). Prints
each time, its speedup over serial and the largest difference of its image from serial's
(relative; stale mode differs by design, sync and cfg only by float rounding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

RANKS = 2
COMPETITORS = ("per call", "ring", "cfg", "hybrid")  # the keys of `competitors`, in order


def dit_pipeline(layers: int) -> Any:
    """The benchmark pipeline, seeded: the same weights in every process."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
        num_layers=layers, sample_size=64, patch_size=2, num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero").eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 16),
        latent_channels=4, norm_num_groups=8, sample_size=128).eval()
    pipe = diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DDIMScheduler(clip_sample=False),
                                 id2label={i: str(i) for i in range(10)})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: Any, steps: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = pipe(class_labels=[3], num_inference_steps=steps, guidance_scale=4.0,
               generator=torch.Generator().manual_seed(0), output_type="np")
    return time.perf_counter() - start, torch.as_tensor(out.images)


def serial(args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    torch.set_num_threads(1)
    pipe = dit_pipeline(args.layers)
    generate(pipe, 1)  # first-call costs
    return generate(pipe, args.steps)


def pipelined(rank: int, world: int, args: argparse.Namespace,
              options: dict[str, Any]) -> tuple[float, torch.Tensor]:
    pipe = dit_pipeline(args.layers)
    tp.pipelines.parallelize(pipe, compiler=args.compiler, **options)
    generate(pipe, 2)  # traces and compiles
    return generate(pipe, args.steps)


def competitors(args: argparse.Namespace) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (ranks, parallelize options)."""
    staged = {"stages": RANKS, "chunks": args.chunks, "mode": args.mode, "warmup_steps": 1}
    return {
        "per call": (RANKS, {**staged, "ring": False}),
        "ring": (RANKS, staged),
        "cfg": (RANKS, {"cfg": 2, "stages": 1}),
        "hybrid": (2 * RANKS, {**staged, "cfg": 2}),
    }


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--steps", type=positive_int, default=20, help="DDIM steps")
    parser.add_argument("--layers", type=positive_int, default=6, help="transformer blocks")
    parser.add_argument("--chunks", type=positive_int, default=2,
                        help="chunks of the staged competitors")
    parser.add_argument("--mode", default="stale", choices=("stale", "sync"),
                        help="the staged competitors' mode")
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"),
                        help="how tokpipe compiles its stages")
    parser.add_argument("--only", nargs="+", choices=COMPETITORS, metavar="COMPETITOR",
                        help="run these competitors only (after serial), of "
                             f"{', '.join(map(repr, COMPETITORS))}")
    parser.add_argument("--hybrid", action="store_true",
                        help="run the 4-rank hybrid even with fewer cores than ranks")
    return parser


def main() -> None:
    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    print(f"DiTPipeline, DiT-S/2 width, {args.layers} layers, 1024 tokens, batch 2 (guidance),"
          f" {args.steps} steps, {args.mode} mode, {args.chunks} chunks, "
          f"{args.compiler} stages", flush=True)
    base, reference = serial(args)
    print(f"{'serial':>10}: {base:7.2f} s", flush=True)
    for name, (ranks, options) in competitors(args).items():
        if args.only and name not in args.only:
            continue
        if ranks > (os.cpu_count() or 1) and not args.hybrid:
            print(f"{name:>10}: skipped ({ranks} ranks of one thread need {ranks} cores; this "
                  f"machine has {os.cpu_count()}; --hybrid runs it anyway)", flush=True)
            continue
        seconds, image = launch(pipelined, ranks, args=(args, options), timeout=3600)[0]
        difference = float((image - reference).abs().max() / reference.abs().max())
        print(f"{name:>10}: {seconds:7.2f} s  {base / seconds:5.2f}x  "
              f"difference {difference:.1e}", flush=True)


if __name__ == "__main__":
    main()
