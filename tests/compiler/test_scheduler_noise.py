"""Scheduler steps that draw noise: `step_table(noise=True)` reads each step's noise scale
off the scheduler (`pipelines/drawn_noise.py`); without it, the table refuses them."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import (
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    LCMScheduler,
)

from tests.compiler.test_schedulers import SHAPE, assert_matches, fake_model
from tokpipe_compiler.pipelines.schedulers import step_table, update_state


def test_a_step_that_fails_on_its_probe_has_the_steps_before_it_replayed_first():
    """SCM (Sana Sprint) keeps one timestep more than its loop steps, and each step reads
    the next: its probe of that entry fails. The steps before it are replayed first, and
    the refusal says what they show: without noise=True, that they draw noise; with it,
    nothing, and the failing step is named."""
    from diffusers import SCMScheduler

    with pytest.raises(ValueError) as info:
        step_table(SCMScheduler(), 4, intermediate_timesteps=None)
    assert "SCMScheduler: its step 0 draws noise" in str(info.value)
    with pytest.raises(ValueError, match=r"SCMScheduler: its step 4 fails on a probe tensor "
                                         r"\(IndexError"):
        step_table(SCMScheduler(), 4, intermediate_timesteps=None, noise=True)


@pytest.mark.parametrize("scheduler", [
    EulerAncestralDiscreteScheduler, lambda: DDPMScheduler(clip_sample=False),
    lambda: LCMScheduler(clip_sample=False),
    lambda: DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"),
], ids=["euler-ancestral", "ddpm", "lcm", "sde-dpmsolver++"])
def test_a_step_that_draws_noise_is_the_table_plus_its_scale_times_the_noise(scheduler):
    """x_next = M_k @ [x, out, state] + noise_k * n_k, with n_k drawn as the scheduler
    draws it: the table with noise=True, fed the same draws from the same generator, is
    the scheduler's own loop step by step."""
    scheduler, steps = scheduler(), 6
    table = step_table(scheduler, steps, noise=True)
    assert table.noise is not None and table.noise[:-1].abs().min() > 0
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    sched, mine, want, got = copy.deepcopy(scheduler), x, x, []
    sched.set_timesteps(steps)
    state = tuple(torch.zeros_like(x) for _ in range(table.state_size))
    drawn, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    scale = getattr(sched, "scale_model_input", lambda sample, t: sample)
    for k, t in enumerate(sched.timesteps):
        want = sched.step(fake_model(scale(want, t), k), t, want, generator=theirs).prev_sample
        mine, state = update_state(mine, fake_model(mine * table.input_scale[k], k), state,
                                   table.rows[k], table.pattern)
        mine = mine + table.noise[k] * torch.randn(SHAPE, generator=drawn)
        got.append((mine, want))
    assert_matches([g for g, _ in got], [w for _, w in got])
