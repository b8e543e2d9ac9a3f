"""One ring step for every step count: a short schedule's table widened to the structure of
the same scheduler's update over a long one computes the short table's numbers exactly, and
a parallelized pipeline keeps one program across step counts."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.compiler.test_schedulers import SHAPE, fake_model, make
from tests.fixtures.pipelines import generate, pixart_alpha, wan
from tokpipe_compiler.pipelines.schedulers import step_table, update_state
from tokpipe_compiler.pipelines.step_structure import LONG_STEPS, widened

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")


def _loop(table, x: torch.Tensor) -> list[torch.Tensor]:
    state = tuple(torch.zeros_like(x) for _ in range(table.state_size))
    xs = []
    for k in range(len(table.timesteps)):
        x, state = update_state(x, fake_model(x * table.input_scale[k], k), state,
                                table.rows[k], table.pattern)
        xs.append(x)
    return xs


NAMES = ["unipc-wan", "unipc-order3", "dpm-eps", "dpm-order3", "deis", "pndm", "ddim-eps",
         "flow-flux"]
CASES = [(name, steps) for name in NAMES for steps in (2, 3, 4, 8)
         if not (name == "pndm" and steps < 4)]  # PNDM's set_timesteps needs 4 or more


@pytest.mark.parametrize(("name", "steps"), CASES)
def test_a_widened_table_has_the_long_structure_and_the_same_numbers(name, steps):
    scheduler, kwargs = make(name, steps)
    table = step_table(scheduler, steps, **kwargs)
    wide = widened(table, scheduler, **kwargs)
    long = step_table(scheduler, LONG_STEPS, **make(name, LONG_STEPS)[1])
    assert wide.state_size == max(table.state_size, long.state_size)
    assert all(set(w) >= set(t) for w, t in zip(wide.pattern, table.pattern, strict=False))
    assert all(set(w) >= set(lg) for w, lg in zip(wide.pattern, long.pattern, strict=False))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(steps))
    for got, want in zip(_loop(wide, x), _loop(table, x), strict=True):
        assert torch.equal(got, want)  # the added terms weigh zero: exactly the same


def test_a_custom_schedule_is_left_as_it_is():
    scheduler, _ = make("flow-flux", 4)
    table = step_table(scheduler, sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.8)
    assert widened(table, scheduler, sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.8) is table


@pytest.mark.parametrize("family", [pixart_alpha, wan], ids=["dpm-solver", "unipc"])
def test_a_pipeline_keeps_one_program_when_the_step_count_changes(family):
    """2, then 3, then 6 steps (the multistep update's state grows with the schedule): one
    traced ring step, and each generation equals the serial pipeline in sync mode."""
    pipe, kwargs = family()
    serial = {steps: generate(pipe, kwargs, steps) for steps in (2, 3, 6)}
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    for steps in (2, 3, 6):
        got = generate(pipe, kwargs, steps)
        scale = serial[steps].abs().max()
        assert (got - serial[steps]).abs().max() <= 1e-5 * scale, steps
    assert len(tp.pipelines.programs(pipe)) == 1
