"""Ring edge cases: empty carry, step counts the per-step values do not cover, zero steps, one
ring run again with another batch or resolution, and carried values of other dtypes and
shapes than the token input."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.pipelines.schedulers import step_table
from tokpipe_compiler.pipelines.step_rows import update_state

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

    def step(joint, image, c):
        joint = joint - c * block(joint, torch.zeros(1, 16))
        return joint, joint[:, 5:]  # the slice makes rows [0, 5) the input's text segment

    ring = tp.Ring(step, carry=["joint", "image"], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match="carried input 'joint' is fed by an output "
                                              "that every chunk computes whole: text tokens"):
        ring.run({"joint": torch.randn(1, 21, 16), "image": torch.randn(1, 16, 16)},
                 per_step={"c": torch.full((3,), 0.1)})


def test_a_ring_over_one_row_of_patches_says_why_it_cannot_carry():
    """One unit: the latents' layout cannot be told from text's, and the error spoke of
    text tokens alone."""
    model = models()[8]  # 16 tokens: here one row of 16 patches

    def step(latents, timestep, c, labels):
        return (latents - c * model(latents, timestep.expand(1), labels),)

    ring = tp.Ring(step, carry=["latents"], **{**OPTIONS, "chunks": 1, "mode": "sync"})
    one_row = {"latents": torch.randn(1, 4, 2, 32), "labels": torch.tensor([1])}
    with pytest.raises(tp.TokpipeError, match="the token grid is one unit here"):
        ring.run(one_row, per_step=PER_STEP)


def _multistep_ring(model: TinyDiT, state_dtype: torch.dtype):
    """A DPM-Solver++ 2M ring over bfloat16 latents, its history carried in `state_dtype`
    (the model computes in float32)."""
    from diffusers import DPMSolverMultistepScheduler

    table = step_table(DPMSolverMultistepScheduler(), 6)
    names = [f"state_{i}" for i in range(table.state_size)]

    def step(latents, timestep, row, labels, **state):
        eps = model(latents.float(), timestep.expand(latents.shape[0]), labels)
        x, new = update_state(latents, eps, [state[n] for n in names], row, table.pattern)
        return (x, *new)

    latents, _, labels = dit_inputs(model, 8)
    first = {"latents": latents.bfloat16(), "labels": labels,
             **{n: torch.zeros_like(latents, dtype=state_dtype) for n in names}}
    per_step = {"timestep": table.timesteps, "row": table.rows}
    return step, ["latents", *names], first, per_step


def test_bfloat16_latents_carry_a_float32_history():
    """The history is float32 where the latents are bfloat16: it is still a token input,
    cut per chunk, so each ring step reads the history the step before wrote (not the
    first step's, computed once per call)."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    step, carry, first, per_step = _multistep_ring(model, torch.float32)
    ring = tp.Ring(step, carry=carry, **{**OPTIONS, "mode": "sync"})
    got = ring.run(dict(first), per_step=per_step)
    values = dict(first)
    for k in range(len(per_step["row"])):
        out = step(**values, **{name: v[k] for name, v in per_step.items()})
        values.update(zip(carry, out, strict=True))
    for name, value in zip(carry, got, strict=True):
        assert value.dtype == values[name].dtype
        assert torch.equal(value, values[name]), name


def test_a_carry_that_comes_back_in_another_dtype_is_a_clear_error():
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = TinyDiT(depth=1, width=32, heads=2, grid=8).eval()
    step, carry, first, per_step = _multistep_ring(model, torch.bfloat16)
    ring = tp.Ring(step, carry=carry, **OPTIONS)
    with pytest.raises(tp.TokpipeError, match=r"carried input 'state_0' is passed as "
                                              r"torch\.bfloat16 but the step returns it as "
                                              r"torch\.float32"):
        ring.run(first, per_step=per_step)


def test_a_carry_not_laid_out_like_the_token_input_is_a_clear_error():
    """A per-token column [B, L, 1] beside tokens [B, L, D] is read as a table, cut per chunk
    from the call's value: a ring would feed every step the first step's column."""
    torch.manual_seed(0)
    block = TinyDiT(depth=1, width=16, heads=2).blocks[0].eval()

    def step(x, column, c):
        out = block(x + column, torch.zeros(1, 16))
        return x - c * out, out.mean(-1, keepdim=True)

    ring = tp.Ring(step, carry=["x", "column"], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match="carried input 'column' is not read as a token "
                                              "input laid out like 'x'"):
        ring.run({"x": torch.randn(1, 16, 16), "column": torch.zeros(1, 16, 1)},
                 per_step={"c": torch.full((3,), 0.1)})
