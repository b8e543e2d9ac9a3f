"""Guided video (batch 2) on two gloo ranks: Latte's residual stream [B * F, H * W, D]
crosses the stage boundary with the batch merged outside the frames (outer 2); every rank
returns what one process computes, call for call, in stale mode."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.compiler.test_video_guidance import guided_inputs, program, run
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

NAME = "LatteTransformer3DModel"
OPTIONS = {"chunks": ZOO[NAME].chunks, "mode": "stale", "warmup_steps": 1}


def calls() -> list[dict]:
    """Warmup, then a stale step on a new input (a lower timestep: the next step)."""
    first, second = guided_inputs(NAME, 1), guided_inputs(NAME, 2)
    second["timestep"] = first["timestep"] * 0.5
    return [first, second]


def _on_ranks(rank: int, world: int) -> list[torch.Tensor]:
    model = build(NAME)
    backend = tp.backend(stages=world, compiler="eager", timeout=60.0, **OPTIONS)
    spread = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        return [spread(**inputs).sample for inputs in calls()]


def test_latte_batch_two_stale_on_two_ranks_equals_one_process():
    local = program(NAME, stages=2, **OPTIONS)
    expected = [run(NAME, local, inputs) for inputs in calls()]
    for results in launch(_on_ranks, 2, timeout=300):
        for got, want in zip(results, expected, strict=True):
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 1e-6 * scale
