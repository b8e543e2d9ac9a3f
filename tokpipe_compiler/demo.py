"""The main job: generate with a DiT on two CPU ranks in ring mode, against the serial loop.

    python -m tokpipe_compiler.demo [--steps 20] [--chunks 4] [--out out/demo.png]

A diffusers DiTTransformer2DModel from a small config with seeded random weights (no download)
denoises a latent with DDIM. The serial run is the plain eager loop on one thread; the
pipelined run is two processes of one thread each, one pipeline stage each, the denoising
loop inside the pipeline. It prints both times, the speedup and the difference between the
two results, and saves the result as an image.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from tokpipe_compiler.config import parse_chunks
from tokpipe_compiler.pipelines.schedulers import step_table, update
from tokpipe_compiler.ring import Ring
from tokpipe_compiler.runtime.launch import launch

SIZES = {  # name: (layers, heads, head dim, latent side)
    "default": (12, 4, 64, 32),
    "small": (2, 2, 16, 16),
}


def build(size: str, steps: int):
    """Model, scheduler table and inputs, identical in every process (fixed seeds)."""
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    layers, heads, head_dim, side = SIZES[size]
    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8,
        num_layers=layers, sample_size=side, patch_size=2, num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero",
    ).eval()
    table = step_table(DDIMScheduler(clip_sample=False), steps)
    latents = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([207])

    def denoise(latents, timestep, input_scale, coeffs, labels):
        out = model(latents * input_scale, timestep=timestep[None], class_labels=labels).sample
        eps = out[:, :4]  # the model also predicts a variance: DDIM uses the noise only
        return update(latents, eps, None, coeffs)

    per_step = {"timestep": table.timesteps, "input_scale": table.input_scale,
                "coeffs": table.coeffs}
    return denoise, latents, labels, per_step


def serial(size: str, steps: int, progress: bool) -> tuple[torch.Tensor, float]:
    torch.set_num_threads(1)
    denoise, x, labels, per_step = build(size, steps)
    bar = _bar(steps, "serial   ", progress)
    start = time.perf_counter()
    with torch.no_grad():
        for k in range(steps):
            x, _ = denoise(x, *(per_step[n][k] for n in ("timestep", "input_scale", "coeffs")),
                           labels)
            bar(k)
    return x, time.perf_counter() - start


def pipelined_rank(rank: int, world: int, size: str, steps: int, options: dict,
                   progress: bool) -> tuple[torch.Tensor, float]:
    denoise, latents, labels, per_step = build(size, steps)
    ring = Ring(denoise, carry=["latents"], stages=world, **options)
    ring.run({"latents": latents, "labels": labels}, per_step=per_step, steps=1)  # plan, compile
    bar = _bar(steps, "pipelined", progress and rank == 0)
    start = time.perf_counter()
    (x,) = ring.run({"latents": latents, "labels": labels}, per_step=per_step, progress=bar)
    return x, time.perf_counter() - start


def _bar(total: int, label: str, show: bool) -> Callable[[int], None]:
    """A tqdm bar on stderr, advanced as each step completes: `report(step)`. Quiet unless
    `show` and a person is watching (stderr a terminal, no CI), or without tqdm."""
    if not (show and interactive()):
        return lambda step: None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the demo extra; the run works without it
        return lambda step: None
    bar = tqdm(total=total, desc=label, unit="step", file=sys.stderr)

    def report(step: int) -> None:
        bar.update(step + 1 - bar.n)  # steps complete in order; the warmup ones come first
        if bar.n >= total:
            bar.close()
    return report


def interactive(environ: Mapping[str, str] = os.environ) -> bool:
    """A person watches: stderr is a terminal and no CI variable is set."""
    return sys.stderr.isatty() and not environ.get("CI")


def save_image(latents: torch.Tensor, path: Path) -> None:
    """The first three latent channels as RGB, each stretched to 0..255, 8x upscaled."""
    from PIL import Image

    rgb = latents[0, :3].float()
    lo = rgb.amin(dim=(1, 2), keepdim=True)
    hi = rgb.amax(dim=(1, 2), keepdim=True)
    pixels = ((rgb - lo) / (hi - lo + 1e-8) * 255).round().byte().permute(1, 2, 0)
    image = Image.fromarray(pixels.numpy()).resize((pixels.shape[1] * 8, pixels.shape[0] * 8),
                                                   Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunks", type=parse_chunks, default=4,
                        help="a count, auto, or token lengths like 1728,960,768,640")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compiler", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--out", type=Path, default=Path("out/tokpipe_demo.png"))
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    options = {"chunks": args.chunks, "mode": "stale", "warmup_steps": 1,
               "compiler": args.compiler, "timeout": 600.0}
    print(f"DiT ({args.size}: {SIZES[args.size]}), DDIM {args.steps} steps, "
          f"{args.ranks} ranks x 1 thread, {args.chunks} chunks, ring mode, {args.compiler}")
    reference, serial_s = serial(args.size, args.steps, not args.quiet)
    results = launch(pipelined_rank, args.ranks, timeout=3600,
                     args=(args.size, args.steps, options, not args.quiet))
    result, pipelined_s = results[0]
    diff = (result - reference).abs().max().item()
    relative = diff / reference.abs().max().item()
    print(f"serial    {serial_s:8.2f} s")
    print(f"pipelined {pipelined_s:8.2f} s")
    print(f"speedup   {serial_s / pipelined_s:8.2f} x")
    print(f"max |pipelined - serial| = {diff:.3e} ({relative:.2e} of max |serial|; stale K/V "
          "after the warmup step make this nonzero by design)")
    save_image(result, args.out)
    print(f"saved {args.out}")
    return 0 if torch.isfinite(result).all() and relative < 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
