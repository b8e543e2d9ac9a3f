"""Image fidelity numbers: PSNR and SSIM of one image against another, and the Frechet
distance between two sets of features. Images are [N, C, H, W] in [0, 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def psnr(image: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per image, in dB for a data range of 1; inf where the two are identical."""
    mse = (image.double() - reference.double()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1 / mse)


def ssim(image: torch.Tensor, reference: torch.Tensor, sigma: float = 1.5) -> torch.Tensor:
    """Per image: the mean structural similarity (Wang et al. 2004, K1=0.01, K2=0.03, a
    Gaussian window of `sigma`). The window is cut to the image side (8x8 images have room
    for no 11x11 window), and stats are taken over valid positions only."""
    x, y = image.double(), reference.double()
    size = min(11, x.shape[-1], x.shape[-2])
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-coords**2 / (2 * sigma**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).expand(x.shape[1], 1, size, size)

    def blur(v: torch.Tensor) -> torch.Tensor:
        return F.conv2d(v, window, groups=x.shape[1])

    c1, c2 = 0.01**2, 0.03**2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return s.flatten(1).mean(1)


def frechet_distance(features: torch.Tensor, reference: torch.Tensor) -> float:
    """||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1 C2)^1/2) between Gaussians fitted to two sets of
    features [N, D]. tr((C1 C2)^1/2) is the sum of the square roots of the eigenvalues of
    C1^1/2 C2 C1^1/2 (symmetric, so eigh is stable)."""
    a, b = features.double(), reference.double()
    mu1, mu2 = a.mean(0), b.mean(0)
    c1, c2 = torch.cov(a.T), torch.cov(b.T)
    vals, vecs = torch.linalg.eigh(c1)
    root1 = vecs @ torch.diag(vals.clamp(min=0).sqrt()) @ vecs.T
    cross = torch.linalg.eigvalsh(root1 @ c2 @ root1).clamp(min=0).sqrt().sum()
    return ((mu1 - mu2).pow(2).sum() + c1.trace() + c2.trace() - 2 * cross).item()
