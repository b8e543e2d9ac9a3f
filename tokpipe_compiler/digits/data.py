"""scikit-learn's digits (1,797 8x8 images in 10 classes) as images in [-1, 1] at any side.

The split is fixed by a seed so that the diffusion model, the classifier and the benchmark
agree on which digits are held out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_SEED = 0
HELD_OUT = 0.2  # fraction of the digits that no model trains on


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as ([N, 1, 8, 8] float32 in [0, 1], [N] int64 labels)."""
    from sklearn.datasets import load_digits  # ships its data: no download

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(data.target, dtype=torch.int64)


def split(part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """'train' or 'held_out': a fixed random 80/20 split of `digits()`."""
    images, labels = digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = int(len(labels) * (1 - HELD_OUT))
    index = {"train": order[:cut], "held_out": order[cut:]}[part]
    return images[index], labels[index]


def at_side(images: torch.Tensor, side: int) -> torch.Tensor:
    """[N, 1, h, w] in [0, 1] -> [N, 1, side, side] in [-1, 1]. Bilinear upsampling (smooth
    strokes rather than 4x4 blocks); area averaging when shrinking."""
    if images.shape[-1] != side:
        mode = "bilinear" if side > images.shape[-1] else "area"
        kwargs = {"align_corners": False} if mode == "bilinear" else {}
        images = F.interpolate(images, size=(side, side), mode=mode, **kwargs)
    return images.clamp(0, 1) * 2 - 1


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """Model space [-1, 1] -> [0, 1], clamped."""
    return ((images + 1) / 2).clamp(0, 1)
