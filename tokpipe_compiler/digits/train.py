"""Trains the shipped digit model from a seed: `python -m tokpipe_compiler.digits.train`.

    python -m tokpipe_compiler.digits.train [--seed 0] [--out DIR] [--schedule 8:32:300,...]

Progressive resolution: each phase `side:batch:steps` trains on the digits bilinearly
upsampled to side x side. Most steps run at 8x8 and 16x16, where a step costs a small part
of one at 32x32; the last phase adapts the model to the 32x32 images the main job makes.
One thread throughout (the run is deterministic for a seed). Writes the weights (float16
safetensors, `from_pretrained`-loadable), the scheduler config, `loss.csv`, `loss.png` and
`samples.png` (one row per seed, one column per class, sampled at 32x32).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokpipe_compiler.digits import data
from tokpipe_compiler.digits.model import SCHEDULER, SIDE, WEIGHTS, new_model, sample, save

SCHEDULE = "8:32:300,16:16:100,32:4:60"  # side:batch:steps per phase; about 15 min


def parse_schedule(text: str) -> list[tuple[int, int, int]]:
    """'8:64:420,16:32:150' -> [(8, 64, 420), (16, 32, 150)]."""
    phases = [tuple(int(v) for v in part.split(":")) for part in text.split(",")]
    if not phases or any(len(p) != 3 or min(p) < 1 for p in phases):
        raise ValueError(f"--schedule wants side:batch:steps[,...], got {text!r}")
    return phases  # type: ignore[return-value]


def train(schedule: list[tuple[int, int, int]], seed: int, lr: float = 6e-4,
          ema_decay: float = 0.99, log: Path | None = None,
          checkpoint: Path | None = None) -> tuple[torch.nn.Module, list]:
    """The trained model (its EMA weights) and the loss log [(step, side, loss)]. With
    `checkpoint`, the EMA weights are saved there after each phase."""
    from diffusers import DDPMScheduler

    torch.set_num_threads(1)
    model = new_model(seed).train()
    for block in model.transformer_blocks:
        # Plain class conditioning: no label dropout (the main job samples without guidance).
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    sched = DDPMScheduler(**SCHEDULER)
    alphas = sched.alphas_cumprod.float()
    images, labels = data.split("train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total, warmup = sum(p[2] for p in schedule), 30
    gen = torch.Generator().manual_seed(seed)
    history: list[tuple[int, int, float]] = []
    step, start = 0, time.perf_counter()
    for side, batch, steps in schedule:
        pixels = data.at_side(images, side)
        for _ in range(steps):
            # linear warmup, then cosine decay to a tenth
            frac = step / max(total - 1, 1)
            cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
            scale = min(1.0, (step + 1) / warmup) * cosine
            for group in opt.param_groups:
                group["lr"] = lr * scale
            index = torch.randint(len(labels), (batch,), generator=gen)
            x0, y = pixels[index], labels[index]
            t = torch.randint(sched.config.num_train_timesteps, (batch,), generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            a = alphas[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
            loss = F.mse_loss(model(xt, timestep=t, class_labels=y).sample, eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                decay = min(ema_decay, (1 + step) / (10 + step))  # short memory early on
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 1 - decay)
            history.append((step, side, loss.item()))
            if log is not None and (step % 10 == 0 or step == total - 1):
                with log.open("a") as f:
                    f.write(f"step {step}/{total} side {side} loss {loss.item():.4f} "
                            f"{time.perf_counter() - start:.0f} s\n")
            step += 1
        if checkpoint is not None:
            save(ema, checkpoint)
    return ema, history


def write_card_assets(model: torch.nn.Module, history: list, out: Path, steps: int = 20,
                      rows: int = 2) -> None:
    """loss.csv, loss.png and samples.png (rows x 10 digits at 32x32) in `out`."""
    from diffusers import DDIMScheduler

    with (out / "loss.csv").open("w") as f:
        f.write("step,side,loss\n")
        f.writelines(f"{s},{side},{loss:.5f}\n" for s, side, loss in history)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None and history:
        steps_, sides, losses = zip(*history, strict=True)
        smooth = torch.tensor(losses).unfold(0, min(20, len(losses)), 1).mean(1)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(steps_, losses, lw=0.5, alpha=0.4, label="per step")
        ax.plot(steps_[len(steps_) - len(smooth):], smooth, lw=1.5, label="mean of 20")
        for s in range(1, len(sides)):
            if sides[s] != sides[s - 1]:
                ax.axvline(steps_[s], color="gray", ls=":")
                ax.text(steps_[s], max(losses) * 0.95, f" {sides[s]}x{sides[s]}", fontsize=8)
        ax.set(xlabel="step", ylabel="noise MSE", yscale="log", title="training loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=110)
        plt.close(fig)
    scheduler = DDIMScheduler(**SCHEDULER)
    labels = torch.arange(10).repeat(rows)
    images = sample(model.eval(), scheduler, labels, list(range(len(labels))), steps, SIDE)
    save_grid(data.to_unit(images), out / "samples.png", columns=10)


def save_grid(images: torch.Tensor, path: Path, columns: int, scale: int = 2) -> None:
    """[N, 1, h, w] in [0, 1] -> one grayscale PNG, `columns` per row, 1-pixel gaps."""
    from PIL import Image

    n, _, h, w = images.shape
    rows = math.ceil(n / columns)
    grid = torch.ones(rows * (h + 1) - 1, columns * (w + 1) - 1)
    for i in range(n):
        r, c = divmod(i, columns)
        grid[r * (h + 1): r * (h + 1) + h, c * (w + 1): c * (w + 1) + w] = images[i, 0]
    pixels = (grid * 255).round().byte().numpy()
    image = Image.fromarray(pixels, mode="L")
    image.resize((image.width * scale, image.height * scale), Image.NEAREST).save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="weights and data order")
    parser.add_argument("--schedule", type=parse_schedule, default=parse_schedule(SCHEDULE),
                        help=f"training phases, as SIDE:BATCH:STEPS,... (default {SCHEDULE})")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    parser.add_argument("--out", type=Path, default=WEIGHTS,
                        help="folder for the weights and model card (default: the shipped "
                             "weights' own folder, which it overwrites)")
    parser.add_argument("--log", type=Path, default=None, help="progress lines, appended")
    parser.add_argument("--no-card", action="store_true", help="skip loss.png / samples.png")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model, history = train(args.schedule, args.seed, args.lr, log=args.log, checkpoint=args.out)
    minutes = (time.perf_counter() - start) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, args.out)
    tail = [loss for _, _, loss in history[-20:]]
    print(f"trained {len(history)} steps in {minutes:.1f} min; final loss (mean of last "
          f"{len(tail)}) {sum(tail) / len(tail):.4f}; saved {args.out}")
    if not args.no_card:
        write_card_assets(model, history, args.out)
        print(f"wrote {args.out}/loss.png and samples.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
