"""Steps a Ring cannot run say why and what to do instead: a diffusers scheduler's step()
inside (refused with Dynamo's account alone, no word of `step_table`), a Python `if` on a
tensor (no word of `torch.where`), a step that fails eagerly too (Dynamo's fake-tensor
error instead of the step's own), a carried name the step never reads (a list of its
inputs padded with None), a step counter carried (an error about scheduler updates)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.ring_trace import StepGraphBreak

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
TIMESTEPS = torch.tensor([900, 500])


torch.manual_seed(0)
MODEL = TinyDiT(depth=1, width=16, heads=2, grid=8).eval()


def _run(step, carry=("latents",), timesteps=TIMESTEPS, **extra):
    latents, _, labels = dit_inputs(MODEL, 8)
    inputs = {"latents": latents, "labels": labels, **extra}
    return tp.Ring(step, carry=list(carry), **OPTIONS).run(inputs,
                                                            per_step={"timestep": timesteps})


@pytest.mark.parametrize("scheduler", [DDIMScheduler(), EulerDiscreteScheduler()],
                         ids=["ddim", "euler"])
def test_a_diffusers_schedulers_step_inside_points_to_step_table(scheduler):
    scheduler.set_timesteps(2)

    def step(latents, timestep, labels):
        eps = MODEL(latents, timestep[None], labels)
        return scheduler.step(eps[:, :4], timestep, latents).prev_sample

    # the scheduler's own timesteps, which its step() takes (an eager loop runs)

    with pytest.raises(tp.TokpipeError, match=r"a diffusers scheduler's step\(\) keeps its "
                                              r"state in Python.*step_table\(scheduler, steps\)"):
        _run(step, timesteps=scheduler.timesteps)


def test_a_python_if_on_a_tensor_points_to_torch_where():
    def step(latents, timestep, labels):
        eps = MODEL(latents, timestep[None], labels)
        if timestep > 500:
            eps = eps * 1.1
        return latents - 0.1 * eps

    with pytest.raises(tp.TokpipeError, match=r"Data-dependent branching.*torch\.where\(cond"):
        _run(step)


def test_a_step_that_fails_eagerly_raises_its_own_error():
    def step(latents, timestep, labels):
        return latents - MODEL(latents, timestep[None], labels)[:, :, :3]  # 8 rows minus 3

    with pytest.raises(RuntimeError, match=r"The size of tensor a \(8\) must match the size "
                                           r"of tensor b \(3\)") as raised:
        _run(step)
    assert "fake" not in str(raised.value)


def test_a_carried_name_the_step_never_reads_lists_only_what_it_reads():
    def step(latents, timestep, x0, labels):
        eps = MODEL(latents, timestep[None], labels)[:, :4]
        return latents - 0.1 * eps, latents - eps

    with pytest.raises(tp.TokpipeError, match=r"'x0' is not an input the step function "
                                              r"reads \(it reads \[[^]N]*'labels'[^]N]*\]\).*pass "
                                              r"each_step="):
        _run(step, carry=("latents", "x0"), x0=torch.zeros(1, 4, 8, 8))


def test_a_carried_step_counter_points_to_per_step():
    def step(latents, timestep, k, labels):
        eps = MODEL(latents, timestep[None], labels)[:, :4]
        return latents - 0.1 * k * eps, k + 1

    with pytest.raises(tp.TokpipeError, match=r"carried input 'k' is fed by an output that is "
                                              r"not laid out like 'latents'.*per_step"):
        _run(step, carry=("latents", "k"), k=torch.ones(1))


def test_a_size_that_depends_on_values_is_refused_as_a_graph_break():
    """Mochi attends over the text tokens its mask keeps (`query[:, :, valid_indices]`):
    a size known only from the values, which the planner's token rules crashed on (an
    internal error). It is refused as a step Dynamo breaks is (a parallelized pipeline
    then runs per call)."""
    def step(latents, timestep, labels, mask):
        kept = latents[:, :, mask.nonzero().flatten()]  # the kept rows only
        return latents - 0.1 * MODEL(latents, timestep[None], labels) + kept.mean()

    mask = torch.zeros(8, dtype=torch.bool)
    mask[:5] = True
    with pytest.raises(StepGraphBreak, match="size depends on tensor values"):
        _run(step, mask=mask)
