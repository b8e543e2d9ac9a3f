"""Ring edge cases: empty carry, step counts the per-step values do not cover, zero steps, and
one ring run again with another batch or resolution."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

OPTIONS = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}
STEPS = 3


def models() -> dict[int, TinyDiT]:
    """One tiny DiT per latent resolution (its positional table fixes the grid)."""
    torch.manual_seed(0)
    return {grid: TinyDiT(depth=2, width=32, heads=2, grid=grid).eval() for grid in (8, 12)}


def make_step(by_grid: dict[int, TinyDiT]):
    def step(latents, timestep, c, labels):
        model = by_grid[latents.shape[-1]]
        eps = model(latents, timestep.expand(latents.shape[0]), labels)
        return (latents - c * eps,)

    return step


def inputs(grid: int = 8, batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    latents, _, labels = dit_inputs(models()[8], grid, seed=seed, batch=batch)
    return {"latents": latents, "labels": labels}


PER_STEP = {"timestep": torch.linspace(900, 100, STEPS).long(),
            "c": torch.linspace(0.3, 0.1, STEPS)}


def run_fresh(first: dict[str, torch.Tensor]) -> torch.Tensor:
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    return ring.run(first, per_step=PER_STEP)[0]


def test_empty_carry_is_a_clear_error():
    with pytest.raises(tp.TokpipeError, match=r"carry=\[\.\.\.\] to name at least one input"):
        tp.Ring(make_step(models()), carry=[], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match="distinct inputs"):
        tp.Ring(make_step(models()), carry=["latents", "latents"], **OPTIONS)


def test_more_steps_than_per_step_values_is_a_clear_error():
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match=r"steps=5 but per-step input\(s\) hold fewer "
                                              r"values: \{'timestep': 3, 'c': 3\}"):
        ring.run(inputs(), per_step=PER_STEP, steps=5)
    for bad in (-1, 1.5, True):
        with pytest.raises(tp.TokpipeError, match="steps must be an int >= 0"):
            ring.run(inputs(), per_step=PER_STEP, steps=bad)
    with pytest.raises(tp.TokpipeError, match=r"steps=\.\.\. or per-step inputs"):
        ring.run(inputs())


def test_zero_steps_return_the_carried_inputs():
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    first = inputs()
    (out,) = ring.run(first, per_step=PER_STEP, steps=0)
    assert out is first["latents"]
    assert ring.program is None  # nothing traced for no step


def test_fewer_steps_than_per_step_values_run_the_first_ones():
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    two = ring.run(inputs(), per_step=PER_STEP, steps=2)[0]
    short = {name: values[:2] for name, values in PER_STEP.items()}
    assert torch.equal(two, run_fresh_with(short))


def run_fresh_with(per_step: dict[str, torch.Tensor]) -> torch.Tensor:
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    return ring.run(inputs(), per_step=per_step)[0]


def test_rerun_with_another_batch_or_resolution_equals_a_fresh_ring():
    ring = tp.Ring(make_step(models()), carry=["latents"], **OPTIONS)
    first = ring.run(inputs(), per_step=PER_STEP)[0]
    for other in (inputs(batch=2, seed=1), inputs(grid=12, seed=2)):
        got = ring.run(other, per_step=PER_STEP)[0]
        assert got.shape == other["latents"].shape
        assert torch.equal(got, run_fresh(other))
    # Back to the first shapes: the first program again, from a fresh generation.
    assert torch.equal(ring.run(inputs(), per_step=PER_STEP)[0], first)
    assert len(ring._programs) == 3


def test_carrying_an_output_with_the_text_stream_is_a_clear_error():
    """Every chunk computes its own copy of text tokens joined to the carried input: no
    chunk's output can be the next step's chunk input."""
    torch.manual_seed(0)
    block = TinyDiT(depth=1, width=16, heads=2).blocks[0].eval()

    def step(joint, c):
        joint = joint - c * block(joint, torch.zeros(1, 16))
        return joint, joint[:, 5:]  # the slice makes rows [0, 5) the input's text segment

    ring = tp.Ring(step, carry=["joint"], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match="carried input 'joint' is fed by an output "
                                              "holding whole text tokens"):
        ring.run({"joint": torch.randn(1, 21, 16)}, per_step={"c": torch.full((3,), 0.1)})
