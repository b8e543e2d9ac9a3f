"""Which generation, denoising step and guidance branch a call belongs to.

A diffusion pipeline calls the transformer once or twice per step (twice when it runs the
conditional and unconditional branches of guidance as two calls), with a timestep that
moves one way from step to step: most pipelines pass one that falls (999 -> 0), some one
that rises (Lumina, Lumina2 and Z-Image pass 1 - t / 1000). Stale K/V must come from the
same branch of the previous step, and never from another image. From the timestep input
alone:

    timestep moving as the schedule moves -> the next step, branch 0 (the schedule's
                                             direction is the first move's of a generation)
    timestep equal, other inputs          -> the same step, the next branch
    timestep equal, equal inputs          -> the next step (a call repeated as it was; its
                                             stale K/V equal the fresh ones either way)
    timestep moving back                  -> a new generation (the next image), step 0

Within a parallelized pipeline's call the scheduler's steps are counted (`StepMarks`), and
a call at an equal timestep is the next step when a scheduler step came between, another
branch otherwise: branches with equal inputs (a negative prompt equal to the prompt) stay
branches, and schedulers that repeat a timestep (Heun) count each step.

Without a timestep input every call is its own step of one branch, and only `tp.reset`,
new input shapes or a pipeline call's end start a new generation. A graph of a model split
at graph breaks (the blocks' graph, fed `temb`, not the timestep) follows the timestep of
the graph of its model that read one before it (`SharedTimesteps`). Under `parallelize`
the transformer's calls are counted once per call instead, and every program run within a
call takes its place (`model_clock`): the graphs of a split model number alike.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from tokpipe_compiler.core.errors import PeerStopped, TokpipeError
from tokpipe_compiler.runtime.run_stops import was_told
from tokpipe_compiler.stage_programs.host_timesteps import HostTimesteps

# The forward's parameter names taken for the timestep, first found first (k-diffusion and
# EDM models take the noise level, `sigma`); the option timestep_input names another.
TIMESTEP_NAMES = ("timestep", "timesteps", "t", "sigma")


@dataclass(frozen=True)
class Tick:
    """Where a call falls: `new_generation` when it starts one."""

    new_generation: bool
    step: int
    branch: int


# Parallelized pipeline calls made by this process, numbered alike on every rank (every
# rank makes the same calls): a message tells which call it belongs to.
_CALLS = itertools.count()


@dataclass
class StepMarks:
    """The scheduler steps a pipeline call has taken so far, and its scheduler."""

    steps: int = 0
    scheduler: Any = None
    # the distributed programs whose per-call generation this call began
    per_call: list = field(default_factory=list)
    call: int = field(default_factory=lambda: next(_CALLS))  # the same on every rank

    def leave(self, error: BaseException, earlier: Sequence[Any] = ()) -> None:
        """The call raised: its peers are told once (`leave_call`), unless the error is a
        peer's leave itself, or it came from inside a program's call, where a peer may wait
        on another message of that call (it waits `timeout`, as before). A call that raised
        before any program ran tells them through one of the pipeline's `earlier` programs
        (none on its first call: the peers wait `timeout`)."""
        if isinstance(error, PeerStopped) or was_told(error) or \
                any(p.mid_call for p in self.per_call):
            return
        tellers = self.per_call or earlier
        if tellers:
            # Over a group a failure closed, the peers meet failures of their own, and the
            # call's own error, not the leave's, is what its caller must see.
            with contextlib.suppress(TokpipeError):
                tellers[0].leave_call(error, self.call)

    def scheduled(self) -> int | None:
        """The timesteps the scheduler was set to run (None: unknown), once the pipeline
        has set them (before its first transformer call)."""
        timesteps = getattr(self.scheduler, "timesteps", None)
        return None if timesteps is None else len(timesteps)


# Set for the duration of a parallelized pipeline's call (pipelines/parallel_pipeline.py).
PIPELINE_STEPS: ContextVar[StepMarks | None] = ContextVar("tokpipe_pipeline_steps",
                                                          default=None)


def count_step() -> None:
    """A scheduler step of the running pipeline call (nothing outside one)."""
    marks = PIPELINE_STEPS.get()
    if marks is not None:
        marks.steps += 1


class StepClock:
    """Counts steps and branches of one generation from the timestep argument at position
    `timestep_index` of the call (None: every call is a step). `inputs`: positions of the
    user's inputs (not weights), compared to tell a branch from a repeated call."""

    def __init__(self, timestep_index: int | None, inputs: Sequence[int] = ()):
        self.timestep_index = timestep_index
        self.inputs = tuple(inputs)
        # Without a timestep argument: where this call's timestep is read instead.
        self.source: Callable[[], float | None] | None = None
        self.timesteps = HostTimesteps()
        self.reset()

    def reset(self) -> None:
        self.last: float | None = None
        self.last_inputs: tuple[Any, ...] = ()
        self.step, self.branch = -1, 0
        self.direction = 0  # +1 rising, -1 falling; 0 until a generation's first move
        self.marks_seen = 0  # the scheduler steps counted at the last call (StepMarks)
        # adopted from a model's clock (`adopt`): its generation, and the model's step
        # at which this clock's generation began
        self.adopted: tuple[int, int] | None = None

    def adopt(self, generation: int, tick: Tick, timestep: float | None) -> Tick:
        """The model call's `tick` (`model_clock`), its step counted from where this
        clock's generation began: a program first called mid-generation warms up there."""
        # None after a reset, or after calls this clock counted itself
        fresh = self.adopted is None or self.adopted[0] != generation
        if fresh:
            self.adopted = (generation, tick.step)
        self.step, self.branch = tick.step - self.adopted[1], tick.branch
        self.last, self.last_inputs = timestep, ()
        return Tick(fresh, self.step, self.branch)

    def tick(self, args: tuple[Any, ...]) -> Tick:
        timestep = self._timestep(args)
        marks = PIPELINE_STEPS.get()
        fresh = self.step < 0
        self.adopted = None
        if timestep is None or self.last is None:
            self.step, self.branch = self.step + 1, 0
        elif timestep == self.last:
            if self._stepped(marks, args):
                self.step, self.branch = self.step + 1, 0
            else:
                self.branch += 1
        elif self._moves_on(timestep):
            self.step, self.branch = self.step + 1, 0
        else:
            self.step, self.branch, fresh = 0, 0, True
            self.direction = 0  # learnt again: one odd generation does not mislead the next
        self.last = timestep
        self.marks_seen = 0 if marks is None else marks.steps
        # The user's inputs only: holding the weights would keep the model alive.
        self.last_inputs = tuple(args[i] for i in self.inputs)
        return Tick(fresh, self.step, self.branch)

    def _moves_on(self, timestep: float) -> bool:
        """Whether a timestep other than the last call's is the next step (the schedule
        going on) rather than a new generation's first (the schedule moving back)."""
        assert self.last is not None
        move = 1 if timestep > self.last else -1
        if self.direction == 0:  # a generation's first move sets which way its steps go
            self.direction = move
        return move == self.direction

    def _stepped(self, marks: StepMarks | None, args: tuple[Any, ...]) -> bool:
        """Whether a call at the last call's timestep is the next step: a scheduler step
        came between (in a parallelized pipeline), or else it repeats the last call.
        Only here are the inputs compared: comparing device tensors waits for the device,
        which a step whose timestep moved on need not do."""
        if marks is not None:
            return marks.steps != self.marks_seen
        return self._repeated(args)

    def _repeated(self, args: tuple[Any, ...]) -> bool:
        """Inputs equal to the last call's: a call repeated, not another branch."""
        if not self.last_inputs:
            return False
        return all(_same(old, args[i]) for old, i in zip(self.last_inputs, self.inputs,
                                                          strict=True))

    def advance(self, steps: int) -> None:
        """`steps` steps ran outside `tick` (a ring), the last at timestep unknown here."""
        self.step += steps
        self.last, self.last_inputs = None, ()

    def _timestep(self, args: tuple[Any, ...]) -> float | None:
        if self.timestep_index is None:
            return None if self.source is None else self.source()
        return self.timesteps.value(args[self.timestep_index])


class SharedTimesteps:
    """Timesteps read by graphs of models split at graph breaks, for the graphs after them
    that take none. A publisher is a graph with one model's weights; a graph without a
    timestep follows the publisher that ran last before its first call (its own model's:
    a model's graphs run one after another)."""

    def __init__(self) -> None:
        self.values: dict[Hashable, float | None] = {}
        self.last: Hashable | None = None
        self.timesteps = HostTimesteps()

    def publish(self, publisher: Hashable, value: Any) -> None:
        self.values[publisher] = self.timesteps.value(value)
        self.last = publisher

    def follow(self) -> Callable[[], float | None] | None:
        """The last publisher's timesteps from now on (None: none published yet)."""
        publisher = self.last
        if publisher is None:
            return None
        return lambda: self.values.get(publisher)


def timestep_names(choice: str | int | None = None) -> tuple[str | int, ...]:
    """The parameter names taken for the timestep, the option's (`choice`) alone if set; a
    position in the call (`choice` an int) first, then the usual names (a call may pass the
    timestep by keyword)."""
    if isinstance(choice, int):
        return (choice, *TIMESTEP_NAMES)
    return TIMESTEP_NAMES if choice is None else (choice,)


def timestep_index(argument_names: list[str | int | None], choice: str | int | None = None
                   ) -> int | None:
    """Position of the timestep among a graph's inputs, by the forward's parameter name
    (`choice`: the option timestep_input)."""
    for name in timestep_names(choice):
        if name in argument_names:
            return argument_names.index(name)
    return None


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return old.shape == new.shape and old.dtype == new.dtype and \
            old.device == new.device and bool(torch.equal(old, new))
    return type(old) is type(new) and old == new
