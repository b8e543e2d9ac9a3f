"""Identifying the timestep input's form (glue.identify), and replaying it per step."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.pipelines.glue import GlueNotFound, identify, model_timesteps

T = torch.tensor(800.0)


def _identify(timestep: torch.Tensor):
    sample = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1))
    call = {"hidden_states": sample, "timestep": timestep}
    return identify([call], [probe], probe, sample, T, 1.0, [])


def test_a_timestep_for_every_sample_is_replayed_over_the_batch():
    glue = _identify((T / 1000).expand(2))
    assert glue.timestep_shape == ()
    timesteps = torch.tensor([800.0, 500.0])
    assert torch.equal(model_timesteps(glue, timesteps, 2),
                       torch.tensor([[0.8, 0.8], [0.5, 0.5]]))


def test_a_timestep_for_every_token_is_replayed_over_the_tokens():
    """Wan 2.2's expand_timesteps: [batch, tokens], t at every token."""
    glue = _identify(T.expand(2, 6))
    assert glue.timestep_shape == (6,)
    replayed = model_timesteps(glue, torch.tensor([800.0, 500.0]), 2)
    assert replayed.shape == (2, 2, 6)
    assert torch.equal(replayed[1], torch.full((2, 6), 500.0))


def test_a_timestep_that_differs_between_tokens_is_refused():
    """Wan 2.2's image-to-video passes t = 0 at the first frame's tokens: not a form the
    ring replays, said at the first step."""
    timestep = T.expand(2, 6).clone()
    timestep[:, :2] = 0
    with pytest.raises(GlueNotFound, match="over the batch"):
        _identify(timestep)


@pytest.mark.parametrize(("passed", "replay"), [
    (lambda t: 1 - t / 1000, lambda t: 1 - t / 1000),  # Lumina2's
    (lambda t: (1000 - t) / 1000, lambda t: (1000 - t) / 1000),  # Z-Image's
])
def test_a_rising_timestep_is_replayed_in_its_own_order(passed, replay):
    """A timestep that rises as t falls, in the pipeline's own arithmetic (the two orders
    round differently in float32)."""
    glue = _identify(passed(T).expand(2))
    timesteps = torch.tensor([800.0, 333.0, 7.0])
    assert torch.equal(model_timesteps(glue, timesteps, 2)[:, 0], replay(timesteps))
