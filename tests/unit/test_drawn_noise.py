"""The noise a scheduler's step draws, recorded from the pipeline's generator, and added to
a ring's steps before any blend (`pipelines/drawn_noise.py`)."""

from __future__ import annotations

import torch
from diffusers import EulerAncestralDiscreteScheduler

from tokpipe_compiler.pipelines.drawn_noise import drawn_noise, with_noise


def _stepped(generator: torch.Generator | None = None, replace=None):
    scheduler = EulerAncestralDiscreteScheduler()
    scheduler.set_timesteps(4)
    x = torch.ones(1, 4, 2, 2)
    scheduler.scale_model_input(x, scheduler.timesteps[0])
    with drawn_noise(scheduler, replace) as drawn:
        out = scheduler.step(torch.zeros_like(x), scheduler.timesteps[0], x,
                             generator=generator).prev_sample
    return out, drawn


def test_the_step_draws_as_it_would_and_the_draw_is_recorded():
    out, drawn = _stepped(torch.Generator().manual_seed(3))
    alone, _ = _stepped(torch.Generator().manual_seed(3))
    assert len(drawn) == 1 and torch.equal(out, alone)
    seeded = torch.Generator().manual_seed(3)
    assert torch.equal(drawn[0], torch.randn(1, 4, 2, 2, generator=seeded))
    zeros, replaced = _stepped(replace=lambda shape, kwargs: torch.zeros(shape))
    assert torch.equal(replaced[0], torch.zeros(1, 4, 2, 2)) and not torch.equal(zeros, out)


def test_noise_is_added_before_the_blend():
    """x = target + keep * (update + noise), as the pipeline blends the stepped latents."""
    like = torch.zeros(2, 3)
    noise = {5: torch.full((2, 3), 2.0)}
    plain = with_noise({}, noise, 4, 3, like)
    assert torch.equal(plain["blend_keep"], torch.ones(3, 2, 3))
    assert torch.equal(plain["blend_target"][1], noise[5])
    assert not plain["blend_target"][[0, 2]].any()
    keep = torch.rand(3, 2, 3)
    target = torch.rand(3, 2, 3)
    blended = with_noise({"blend_keep": keep, "blend_target": target}, noise, 4, 3, like)
    update = torch.randn(2, 3)
    got = blended["blend_target"][1] + blended["blend_keep"][1] * update
    assert torch.allclose(got, target[1] + keep[1] * (update + noise[5]))
    assert with_noise({"blend_keep": keep}, {}, 4, 3, like) == {"blend_keep": keep}
