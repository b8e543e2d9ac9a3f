"""Identifying a latent joined with a fixed condition (glue.identify), and replaying it."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.pipelines.glue import (
    GlueNotFound,
    carried_input,
    condition_part,
    identify,
    latent_positions,
    model_input,
)

T = torch.tensor(800.0)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _identify(latent_input: torch.Tensor, sample: torch.Tensor, probe: torch.Tensor,
              noise_pred: torch.Tensor):
    call = {"hidden_states": latent_input, "timestep": (T / 1000).expand(sample.shape[0])}
    return identify([call], [probe], noise_pred, sample, T, 1.0, [])


def test_condition_tokens_joined_after_the_latent_are_positions():
    """Flux Kontext: the image's tokens after the latent's; the prediction keeps the
    latent's."""
    sample, condition = _randn(1, 4, 3, seed=0), _randn(1, 2, 3, seed=1)
    probe = _randn(1, 6, 3, seed=2)
    glue = _identify(torch.cat([sample, condition], 1), sample, probe, probe[:, :4])
    assert (glue.condition_dim, glue.condition_size, glue.condition_positions) == (1, 2, True)
    assert torch.equal(condition_part(glue, torch.cat([sample, condition], 1)), condition)
    carried = torch.cat([sample, condition], 1)
    positions = latent_positions(glue, carried)
    assert positions.shape == (1, 6, 1) and positions.flatten().tolist() == [True] * 4 + [False] * 2
    # the latent's positions scaled, the condition's as they are
    replayed = carried_input(glue, carried, torch.tensor(0.5), positions)
    assert torch.equal(replayed, torch.cat([sample * 0.5, condition], 1))


def test_condition_channels_joined_after_the_latent_are_features():
    """Wan's image-to-video: the image's latents and mask join the latent's channels; the
    prediction has the latent's channels."""
    sample, condition = _randn(1, 4, 2, 3, 3, seed=0), _randn(1, 5, 2, 3, 3, seed=1)
    probe = _randn(1, 4, 2, 3, 3, seed=2)
    joined = torch.cat([sample, condition], 1)
    glue = _identify(joined, sample, probe, probe)
    assert (glue.condition_dim, glue.condition_size, glue.condition_positions) == (1, 5, False)
    assert glue.channels is None
    assert torch.equal(model_input(glue, sample, torch.tensor(1.0), condition), joined)


def test_a_latent_passed_alone_has_no_condition():
    sample = _randn(1, 4, 3, seed=0)
    probe = _randn(1, 4, 3, seed=2)
    glue = _identify(sample.clone(), sample, probe, probe)
    assert (glue.condition_dim, glue.condition_size, glue.condition_positions) == (None, 0, False)


def test_a_condition_joined_before_the_latent_is_not_replayed():
    sample, condition = _randn(1, 4, 3, seed=0), _randn(1, 2, 3, seed=1)
    probe = _randn(1, 6, 3, seed=2)
    with pytest.raises(GlueNotFound, match="joined with a fixed condition after it"):
        _identify(torch.cat([condition, sample], 1), sample, probe, probe[:, 2:])
