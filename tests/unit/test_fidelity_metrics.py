"""The fidelity metrics on inputs whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from tokpipe_compiler.digits.metrics import frechet_distance, psnr, ssim


@pytest.fixture
def images() -> torch.Tensor:
    return torch.rand(4, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1


def test_identical_images_give_the_ideal_values(images):
    assert torch.isinf(psnr(images, images)).all()
    assert torch.allclose(ssim(images, images), torch.ones(4, dtype=torch.float64))


def test_a_shifted_image_gives_its_known_psnr(images):
    # a constant offset c is an MSE of c^2: 10 log10(1 / c^2) dB; 0.1 -> 20 dB
    assert torch.allclose(psnr(images + 0.1, images), torch.full((4,), 20.0, dtype=torch.float64))
    assert torch.allclose(psnr(images - 0.01, images), torch.full((4,), 40.0, dtype=torch.float64))


def test_known_noise_gives_its_psnr_and_lowers_ssim(images):
    # +-s with equal counts: the MSE is exactly s^2
    sign = torch.ones_like(images).flatten(1)
    sign[:, ::2] = -1
    noisy = images + 0.05 * sign.view_as(images)
    assert torch.allclose(psnr(noisy, images), torch.full((4,), -20 * math.log10(0.05),
                                                          dtype=torch.float64))
    assert (ssim(noisy, images) < 0.99).all()
    other = torch.rand(images.shape, generator=torch.Generator().manual_seed(9))
    assert (ssim(noisy, images) > ssim(other, images) + 0.5).all()


def test_ssim_works_on_8x8_images():
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ssim(x, x), torch.ones(2, dtype=torch.float64))
    assert (ssim(1 - x, x) < 0).all()  # an inverted image is anti-correlated


def test_frechet_distance_of_a_set_with_itself_is_zero_and_grows_with_a_shift():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(500, 8, generator=gen, dtype=torch.float64)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    # a mean shift of d adds d^2 per dimension, covariances unchanged
    assert frechet_distance(a + 0.5, a) == pytest.approx(8 * 0.25, rel=1e-6)
    # two Gaussians with covariances I and 4I, equal means: tr(I + 4I - 2*2I) = D
    b = torch.randn(200_000, 8, generator=gen, dtype=torch.float64)
    assert frechet_distance(2 * b, b) == pytest.approx(8.0, rel=0.02)
