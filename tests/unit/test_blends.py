"""Latents blended with a noised image between steps (inpainting): found from what the
pipeline did to the probes' latents, checked at every step, replayed per step."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.pipelines.blends import BlendNotFound, Blends


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


MASK = (torch.arange(8) % 3 == 0).float().reshape(1, 8, 1)  # 1: the step's latents kept


def _blend(noised: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor = MASK):
    return (1 - mask) * noised + mask * latents  # as diffusers' inpainting pipelines write it


def test_a_blend_is_found_checked_and_replayed_per_step():
    blends = Blends()
    for step in (1, 2):
        before, noised = _randn(1, 8, 4, seed=step), _randn(1, 8, 4, seed=10 + step)
        blends.noised[step] = noised
        blends.observe(step, before, _blend(noised, before))
    assert torch.equal(blends.keep, MASK.expand(1, 8, 4))
    latents = _randn(1, 8, 4, seed=5)
    inputs = blends.per_step(0, 3, latents)
    assert inputs["blend_keep"].shape == (3, 1, 8, 4)
    # after steps 0 and 1 the blends seen at steps 1 and 2, after step 2 none
    for k in (0, 1):
        replayed = inputs["blend_target"][k] + inputs["blend_keep"][k] * latents
        assert torch.equal(replayed, _blend(blends.noised[k + 1], latents))
    assert torch.equal(inputs["blend_target"][2] + inputs["blend_keep"][2] * latents, latents)
    assert blends.per_step(2, 1, latents) == {}  # no blend after step 2


def test_latents_changed_without_a_noised_image_are_refused():
    with pytest.raises(BlendNotFound, match="between two steps"):
        Blends().observe(1, _randn(1, 8, 4, seed=1), _randn(1, 8, 4, seed=2))


def test_a_blend_whose_mask_changes_between_steps_is_refused():
    blends = Blends()
    for step, mask in ((1, MASK), (2, 1 - MASK)):
        before, noised = _randn(1, 8, 4, seed=step), _randn(1, 8, 4, seed=10 + step)
        blends.noised[step] = noised
        if step == 1:
            blends.observe(step, before, _blend(noised, before, mask))
        else:
            with pytest.raises(BlendNotFound, match="one mask"):
                blends.observe(step, before, _blend(noised, before, mask))


def test_a_soft_mask_is_found_too():
    mask = torch.linspace(0, 1, 8).reshape(1, 8, 1)
    blends = Blends()
    before, noised = _randn(1, 8, 4, seed=1), _randn(1, 8, 4, seed=2)
    blends.noised[1] = noised
    blends.observe(1, before, _blend(noised, before, mask))
    assert torch.allclose(blends.keep, mask.expand(1, 8, 4), atol=1e-5)


def test_a_mask_the_first_blend_cannot_tell_is_told_by_a_later_one():
    """In half precision the probes' latents can equal the noised image at some positions:
    any mask gives the noised image there, so a later step tells the mask."""
    blends = Blends()
    latents = _randn(1, 8, 4, seed=5)
    for step in (1, 2):
        before, noised = _randn(1, 8, 4, seed=step), _randn(1, 8, 4, seed=10 + step)
        if step == 1:
            before[0, :3] = noised[0, :3]
        blends.noised[step] = noised
        blends.observe(step, before, _blend(noised, before))
        if step == 1:
            assert blends.keep.isnan().sum() == 12
            with pytest.raises(BlendNotFound, match="could not tell at 12 positions"):
                blends.per_step(0, 2, latents)
    assert torch.equal(blends.keep, MASK.expand(1, 8, 4))
    assert set(blends.per_step(0, 3, latents)) == {"blend_keep", "blend_target"}
