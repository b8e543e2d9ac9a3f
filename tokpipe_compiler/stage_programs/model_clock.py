"""Steps and branches counted once per call of a parallelized transformer.

Each program counts the calls it runs (`StepClock`). That numbers steps and branches
right while every call of the model runs every program. A model split at graph breaks
breaks that: a guider that hooks the transformer for one branch (PAG, skip-layer and
auto guidance) makes Dynamo trace other graphs, some run in one branch only, some first
called mid-generation. Counting its own calls, such a graph numbers the perturbed branch
of step 1 "step 0, branch 0", and the conditional branch of step 2 then reads that
branch's K/V as its stale ones.

Under `parallelize` every call of the transformer passes through `clocked`, which ticks
the model's clock once per call and lets the programs that run within the call take its
step and branch (`StepClock.adopt`). A program first called mid-generation starts its own
generation there: its first steps warm up as a generation's first steps do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from tokpipe_compiler.stage_programs.generations import (
    PIPELINE_STEPS,
    StepClock,
    StepMarks,
    Tick,
    timestep_names,
)


@dataclass(frozen=True)
class ModelTick:
    """Where a call of the model falls: its generation's number (within this model), the
    step and branch, and the session whose programs take them."""

    session: Any
    generation: int
    tick: Tick
    timestep: float | None


# Set for the duration of a parallelized transformer's call.
MODEL_CALL: ContextVar[ModelTick | None] = ContextVar("tokpipe_model_call", default=None)


class ModelClock:
    """One transformer's clock: a generation per pipeline call (and per schedule started
    again within one), steps and branches told apart as `StepClock` tells them, from the
    call's timestep and the scheduler steps between calls."""

    def __init__(self, forward: Callable[..., Any], timestep_input: str | int | None,
                 session: Any):
        try:
            self.signature: inspect.Signature | None = inspect.signature(forward)
        except (TypeError, ValueError):  # no signature to read: the keywords alone
            self.signature = None
        self.names = timestep_names(timestep_input)
        self.session = session
        self.clock = StepClock(0)
        self.generations = 0
        self.call: int | None = None  # the pipeline call the generation belongs to

    def tick(self, args: tuple, kwargs: dict[str, Any], marks: StepMarks) -> ModelTick:
        if marks.call != self.call:  # every pipeline call starts afresh
            self.clock.reset()
            self.call = marks.call
        # Without a timestep the scheduler steps taken stand in for one: they only rise.
        timestep = self._timestep(args, kwargs)
        tick = self.clock.tick((float(marks.steps) if timestep is None else timestep,))
        self.generations += tick.new_generation
        return ModelTick(self.session, self.generations, tick,
                         None if timestep is None else self.clock.last)

    def _timestep(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            bound = kwargs if self.signature is None else \
                self.signature.bind(*args, **kwargs).arguments
        except TypeError:  # the call itself raises, as it would unclocked
            return None
        for name in self.names:
            if isinstance(name, int):
                if name < len(args):
                    return args[name]
            elif name in bound:
                return bound[name]
            elif name in kwargs:  # through the forward's **kwargs
                return kwargs[name]
        return None


def clocked(call: Callable[..., Any], clock: ModelClock) -> Callable[..., Any]:
    """`call` (the transformer's compiled call) ticking `clock` at each call made within a
    parallelized pipeline's call; outside one, each program counts its own calls."""

    def clocked_call(*args: Any, **kwargs: Any) -> Any:
        marks = PIPELINE_STEPS.get()
        if marks is None:
            return call(*args, **kwargs)
        token = MODEL_CALL.set(clock.tick(args, kwargs, marks))
        try:
            return call(*args, **kwargs)
        finally:
            MODEL_CALL.reset(token)

    return clocked_call
