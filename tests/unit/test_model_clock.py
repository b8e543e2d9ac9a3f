"""A parallelized transformer's clock: steps and branches counted once per model call
(the scheduler steps between calls telling them apart), a generation per pipeline call,
and the programs within a call taking its place (`StepClock.adopt`)."""

from __future__ import annotations

import torch

from tokpipe_compiler.stage_programs.generations import StepClock, StepMarks, Tick
from tokpipe_compiler.stage_programs.model_clock import ModelClock


def forward(hidden_states, timestep=None, encoder_hidden_states=None):
    raise AssertionError("never called")


def model_ticks(clock: ModelClock, marks: StepMarks, timesteps: list) -> list[tuple]:
    """Two calls at each timestep (guidance's branches), a scheduler step after them."""
    found = []
    for t in timesteps:
        for _ in range(2):
            tick = clock.tick((torch.zeros(1),), {"timestep": t}, marks)
            found.append((tick.generation, tick.tick.step, tick.tick.branch))
        marks.steps += 1
    return found


def test_branches_and_steps_by_the_scheduler_steps_between_calls():
    clock, marks = ModelClock(forward, None, None), StepMarks()
    t = torch.tensor([900.0, 900.0])
    assert model_ticks(clock, marks, [t, t * 0.5]) == [(1, 0, 0), (1, 0, 1), (1, 1, 0),
                                                       (1, 1, 1)]


def test_every_pipeline_call_starts_a_generation():
    """Even where the timestep does not move back (a one-step pipeline called twice)."""
    clock = ModelClock(forward, None, None)
    first = model_ticks(clock, StepMarks(), [torch.tensor(1.0)])
    second = model_ticks(clock, StepMarks(), [torch.tensor(1.0)])
    assert first == [(1, 0, 0), (1, 0, 1)] and second == [(2, 0, 0), (2, 0, 1)]


def test_without_a_timestep_the_scheduler_steps_tell_the_steps():
    clock, marks = ModelClock(forward, None, None), StepMarks()
    assert model_ticks(clock, marks, [None, None]) == [(1, 0, 0), (1, 0, 1), (1, 1, 0),
                                                       (1, 1, 1)]


def test_a_program_first_called_mid_generation_starts_its_generation_there():
    """Called first in branch 2 of step 1 (a guider's hooked branch), a program numbers
    its steps from there and keeps the model's branches; a new model generation is one
    for it too."""
    clock = StepClock(None)
    assert clock.adopt(1, Tick(False, 1, 2), 0.5) == Tick(True, 0, 2)
    assert clock.adopt(1, Tick(False, 2, 0), 0.2) == Tick(False, 1, 0)
    assert clock.adopt(1, Tick(False, 2, 2), 0.2) == Tick(False, 1, 2)
    assert clock.adopt(2, Tick(True, 0, 0), 1.0) == Tick(True, 0, 0)
    clock.reset()  # tp.reset mid-generation: the next call starts this program's again
    assert clock.adopt(2, Tick(False, 1, 0), 0.5) == Tick(True, 0, 0)


def test_a_forward_without_a_signature_reads_the_timestep_by_keyword():
    class Unsigned:
        __signature__ = "not one"  # inspect.signature raises TypeError

        def __call__(self, *args, **kwargs):
            raise AssertionError("never called")

    clock, marks = ModelClock(Unsigned(), None, None), StepMarks()
    assert model_ticks(clock, marks, [torch.tensor(900.0), torch.tensor(800.0)]) == [
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert clock.tick((), {"timestep": torch.tensor(700.0)}, marks).timestep == 700.0
