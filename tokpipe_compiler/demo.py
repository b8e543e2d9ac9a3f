"""The main job: generate digits with the shipped DiT on two CPU ranks in ring mode, against
the serial loop.

    python -m tokpipe_compiler.demo [--steps 20] [--chunks 4] [--out out/tokpipe_demo.png]

The shipped class-conditional DiT (trained on scikit-learn's digits, see
tokpipe_compiler/digits/weights/README.md) draws one digit of each class, 0 to 9, as a batch
of 32x32 images (1,024 tokens each) with DDIM. The serial run is the plain eager loop on one
thread; the pipelined run is two processes of one thread each, one pipeline stage each, the
denoising loop inside the pipeline. It prints both times, the speedup and how far the
pipelined digits are from the serial ones (PSNR, SSIM, and what the digit classifier reads
in each), and saves serial | pipelined | difference side by side.
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
from tokpipe_compiler.digits import data, metrics
from tokpipe_compiler.digits.model import denoiser, load, noise, per_step
from tokpipe_compiler.ring import Ring
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

SIDES = {"default": 32, "small": 8}  # image side: 1,024 or 64 tokens
DIFF_GAIN = 10  # the difference panel shows 10 x |pipelined - serial|


def build(size: str, steps: int):
    """Step function, starting noise, labels 0..9 and per-step inputs; identical in every
    process (the weights are read from the package, the noise from fixed seeds)."""
    model, scheduler = load()
    labels = torch.arange(10)
    return denoiser(model), noise(range(10), SIDES[size]), labels, per_step(scheduler, steps)


def serial(size: str, steps: int, progress: bool) -> tuple[torch.Tensor, float]:
    torch.set_num_threads(1)
    denoise, x, labels, inputs = build(size, steps)
    bar = _bar(steps, "serial   ", progress)
    start = time.perf_counter()
    with torch.no_grad():
        for k in range(steps):
            x, _ = denoise(x, *(inputs[n][k] for n in ("timestep", "input_scale", "coeffs")),
                           labels)
            bar(k)
    return x, time.perf_counter() - start


def pipelined_rank(rank: int, world: int, size: str, steps: int, options: dict,
                   progress: bool) -> tuple[torch.Tensor, float]:
    denoise, latents, labels, inputs = build(size, steps)
    ring = Ring(denoise, carry=["latents"], stages=world, **options)
    ring.run({"latents": latents, "labels": labels}, per_step=inputs, steps=1)  # plan, compile
    bar = _bar(steps, "pipelined", progress and rank == 0)
    start = time.perf_counter()
    (x,) = ring.run({"latents": latents, "labels": labels}, per_step=inputs, progress=bar)
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


def fidelity(serial_x: torch.Tensor, pipelined_x: torch.Tensor) -> dict[str, float]:
    """Pipelined against serial, on images in [0, 1], and the classifier's reading of each
    (the fraction of the 10 digits read as the class asked for)."""
    from tokpipe_compiler.digits.classifier import classify, load_classifier

    a, b = data.to_unit(serial_x), data.to_unit(pipelined_x)
    clf, labels = load_classifier(), torch.arange(len(a))
    return {
        "psnr_db": metrics.psnr(b, a).mean().item(),
        "ssim": metrics.ssim(b, a).mean().item(),
        "max_abs": (b - a).abs().max().item(),
        "serial_acc": (classify(clf, serial_x)[0] == labels).float().mean().item(),
        "pipelined_acc": (classify(clf, pipelined_x)[0] == labels).float().mean().item(),
    }


def save_image(serial_x: torch.Tensor, pipelined_x: torch.Tensor, path: Path,
               scale: int = 4) -> None:
    """Serial | pipelined | DIFF_GAIN x |difference|, each panel 2 rows of 5 digits in
    grayscale, `scale` x enlarged, with a white border between panels."""
    from PIL import Image

    a, b = data.to_unit(serial_x), data.to_unit(pipelined_x)
    panels = [_grid(a), _grid(b), _grid((DIFF_GAIN * (b - a).abs()).clamp(0, 1))]
    gap = torch.ones(panels[0].shape[0], 2)
    pixels = torch.cat([panels[0], gap, panels[1], gap, panels[2]], dim=1)
    image = Image.fromarray((pixels * 255).round().byte().numpy(), mode="L")
    image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def image_path(out: Path, parser: argparse.ArgumentParser) -> Path:
    """`--out` as an image file: a folder (or a name without a suffix) gets the default
    name inside; a suffix PIL cannot write is refused before the run, not after it."""
    if out.is_dir() or not out.suffix:
        return out / DEFAULT_NAME
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        parser.error(f"--out {out}: '{out.suffix}' is not an image format; use one of "
                     f"{', '.join(IMAGE_SUFFIXES)}, or a folder")
    return out


def _grid(images: torch.Tensor, columns: int = 5) -> torch.Tensor:
    """[N, 1, s, s] -> [rows * (s + 1) + 1, columns * (s + 1) + 1], gray 1-pixel lines."""
    n, _, s, _ = images.shape
    rows = -(-n // columns)
    grid = torch.full((rows * (s + 1) + 1, columns * (s + 1) + 1), 0.5)
    for i in range(n):
        r, c = divmod(i, columns)
        grid[1 + r * (s + 1): 1 + r * (s + 1) + s, 1 + c * (s + 1): 1 + c * (s + 1) + s] = \
            images[i, 0]
    return grid


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
DEFAULT_NAME = "tokpipe_demo.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIDES), default="default",
                        help="default: 32x32 images (1,024 tokens); small: 8x8 (64 tokens)")
    parser.add_argument("--steps", type=int, default=20, help="DDIM steps")
    parser.add_argument("--chunks", type=parse_chunks, default=4,
                        help="a count, auto, or token lengths like 384,256,224,160")
    parser.add_argument("--ranks", type=int, default=2, help="processes, one stage each")
    parser.add_argument("--compiler", choices=["eager", "inductor"], default="eager",
                        help="how each stage runs")
    parser.add_argument("--out", type=Path, default=Path("out") / DEFAULT_NAME,
                        help=f"the image to save (a folder: {DEFAULT_NAME} in it)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.out = image_path(args.out, parser)
    options = {"chunks": args.chunks, "mode": "stale", "warmup_steps": 1,
               "compiler": args.compiler, "timeout": 600.0}
    side = SIDES[args.size]
    say_if_busy()  # the ranks' speedups need the cores to themselves
    print(f"digits 0-9 from the shipped DiT ({side}x{side} pixels = {side * side} tokens), "
          f"DDIM {args.steps} steps, {args.ranks} ranks x 1 thread, {args.chunks} chunks, "
          f"ring mode, {args.compiler}")
    reference, serial_s = serial(args.size, args.steps, not args.quiet)
    results = launch(pipelined_rank, args.ranks, timeout=3600,
                     args=(args.size, args.steps, options, not args.quiet))
    result, pipelined_s = results[0]
    numbers = fidelity(reference, result)
    print(f"serial    {serial_s:8.2f} s")
    print(f"pipelined {pipelined_s:8.2f} s")
    print(f"speedup   {serial_s / pipelined_s:8.2f} x")
    print(f"pipelined vs serial: PSNR {numbers['psnr_db']:.1f} dB, SSIM {numbers['ssim']:.4f}, "
          f"max |difference| {numbers['max_abs']:.3f} of the 0..1 range (stale K/V after the "
          "warmup step make it nonzero by design)")
    print(f"digits read as the class asked for: serial {numbers['serial_acc']:.0%}, "
          f"pipelined {numbers['pipelined_acc']:.0%}")
    save_image(reference, result, args.out)
    print(f"saved {args.out} (serial | pipelined | {DIFF_GAIN}x difference)")
    return 0 if torch.isfinite(result).all() and numbers["psnr_db"] > 15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
