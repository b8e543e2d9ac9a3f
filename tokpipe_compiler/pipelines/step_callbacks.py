"""A pipeline's step callbacks in a ring generation.

The pipeline's loop runs on probes before the ring computes anything, so a callback it
called then would see made-up latents. `StepCallbacks` stands in for the user's: during
that loop it records each call (the loop step, the timestep, the tensors asked for); the
ring then shows it each step's latents as they are computed (`Ring.run(each_step=)`), and
it calls the user's callback with them and the recorded rest. The last step's callback, which
the pipeline calls after the ring with real latents, goes straight through.

A ring computes every step from the first step's form, so it cannot follow a callback that
changes the generation: tensors it returns changed or the guidance scale set anew raise
once the ring has run (on every rank alike; a callback that does so runs with
`parallelize(pipe, ring=False)`). An interrupt (`pipe._interrupt = True`, where the
pipeline's loop reads one) set by a callback ends the generation at its step, as in the
pipeline's own loop: the pipeline gets the latents of that step. In one process, one set
from another thread, with or without callbacks, ends it at the step the ring shows next
(one set while the loop runs on probes, at the first step: the loop does not see it then);
on several ranks, where each would see it at another step, only a callback's counts.
In one process the ring stops there too (`StopRing`), and so after a callback
that raises (a server's cancel); on several ranks it runs its steps to the end (a rank
whose callback the others do not pass cannot stop them mid-ring), and then the ranks agree
(`segment_ends`): an interrupt on one rank ends the generation on every rank at its step,
an error on one ends the call on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.glue import same
from tokpipe_compiler.pipelines.probes import RingUnavailable

# What a callback may read off the pipeline and its scheduler besides its arguments (the
# scheduler's step index, to find the step's sigma for a preview), as the step had them:
# recorded in the loop, set while the callback runs in the ring.
LOOP_STATE = (("pipe", "_current_timestep"), ("scheduler", "_step_index"))
ON_STEP_END = "callback_on_step_end"
LEGACY = "callback"  # PixArt's `callback(step_index, timestep, latents)`
_MISSING = object()


@dataclass
class _Call:
    """One callback call of the probe loop, to make with real latents."""

    legacy: bool
    index: Any  # the step index the pipeline passed
    timestep: Any
    tensors: dict[str, Any]  # what the callback asked for (callback_kwargs)
    dtype: torch.dtype | None  # the latents' as the pipeline held them
    state: dict[tuple[str, str], Any]  # LOOP_STATE as the loop had it


class StopRing(Exception):
    """Raised by `StepCallbacks.see` in one process at the step a callback interrupted the
    generation or raised at: the ring stops there (no peer waits for its messages), and its
    caller takes what the callback left (`interrupted`, `raise_error`)."""


class StepCallbacks:
    """Stands in for a generation's step callbacks (see the module's docstring).

    loop_step(): the steps the loop has taken (the step a callback follows is one less).
    probing(): whether the loop's values are probes (else they are real, and the
    callbacks go straight through)."""

    def __init__(self, pipe: Any, kwargs: dict[str, Any], loop_step: Callable[[], int],
                 probing: Callable[[], bool]):
        self.pipe, self.loop_step, self.probing = pipe, loop_step, probing
        self.on_step_end = kwargs.get(ON_STEP_END)
        self.legacy = kwargs.get(LEGACY)
        self.interrupted: torch.Tensor | None = None  # the latents of the step it ended at
        self.interrupted_step: int | None = None  # and that step
        self.error: BaseException | None = None
        self._alone = not (dist.is_available() and dist.is_initialized())  # no peers
        self._interruptible = interruptible(pipe)
        self._calls: dict[int, list[_Call]] = {}
        self._first: dict[str, Any] = {}  # each asked tensor as the first step had it

    def call_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The pipeline call's arguments with the callbacks replaced by this one's."""
        out = dict(kwargs)
        if self.on_step_end is not None:
            out[ON_STEP_END] = self._on_step_end
            inputs = getattr(self.on_step_end, "tensor_inputs", None)
            if inputs is not None and "callback_on_step_end_tensor_inputs" not in kwargs:
                out["callback_on_step_end_tensor_inputs"] = list(inputs)
        if self.legacy is not None:
            out[LEGACY] = self._legacy
        return out

    # -- what the pipeline calls ------------------------------------------------------------

    def _on_step_end(self, pipe: Any, index: Any, timestep: Any,
                     tensors: dict[str, Any]) -> dict[str, Any]:
        if not self.probing():
            return tensors if self.interrupted is not None else \
                self.on_step_end(pipe, index, timestep, tensors)
        self._check_asked(tensors)
        latents = tensors.get("latents")
        self._record(_Call(False, index, timestep, dict(tensors),
                           None if latents is None else latents.dtype, self._loop_state()))
        return tensors

    def _legacy(self, index: Any, timestep: Any, latents: torch.Tensor) -> None:
        if not self.probing():
            if self.interrupted is None:
                self.legacy(index, timestep, latents)
            return
        self._record(_Call(True, index, timestep, {}, latents.dtype, self._loop_state()))

    def _record(self, call: _Call) -> None:
        self._calls.setdefault(self.loop_step() - 1, []).append(call)

    def _owners(self) -> dict[str, Any]:
        return {"pipe": self.pipe, "scheduler": getattr(self.pipe, "scheduler", None)}

    def _loop_state(self) -> dict[tuple[str, str], Any]:
        owners = self._owners()
        return {(owner, attr): getattr(owners[owner], attr) for owner, attr in LOOP_STATE
                if hasattr(owners[owner], attr)}

    @contextlib.contextmanager
    def _as_in_the_loop(self, state: dict[tuple[str, str], Any]) -> Iterator[None]:
        owners = self._owners()
        now = self._loop_state()
        for (owner, attr), value in state.items():
            setattr(owners[owner], attr, value)
        try:
            yield
        finally:
            for (owner, attr), value in now.items():
                setattr(owners[owner], attr, value)

    def _check_asked(self, tensors: dict[str, Any]) -> None:
        """The tensors other than the latents must be the generation's fixed ones (the
        prompt embeddings, a mask): one that changes from step to step comes from the
        probes."""
        for name, value in tensors.items():
            if name == "latents":
                continue
            first = self._first.setdefault(name, value)
            if not same(value, first):
                raise RingUnavailable(
                    f"the step-end callback asks for {name!r}, which the pipeline derives "
                    "anew each step; the ring cannot show a callback its real value")

    # -- what the ring shows ----------------------------------------------------------------

    def see(self, step: int, latents: torch.Tensor) -> None:
        """The latents after loop step `step`: the callbacks the loop made after it, now."""
        for call in self._calls.pop(step, []):
            if self.interrupted is not None or self.error is not None:
                break
            try:
                with self._as_in_the_loop(call.state):
                    self._replay(step, call, latents)
            # Raised after the ring: mid-ring, the other ranks would wait. A server's cancel
            # (KeyboardInterrupt, asyncio.CancelledError) is held the same way.
            except BaseException as err:
                self.error = err
        if self.interrupted is None and self.error is None and self._alone and \
                self._interrupted():  # a cancel from another thread
            self.interrupted, self.interrupted_step = latents, step
        if self._alone and (self.error is not None or self.interrupted is not None):
            raise StopRing

    def raise_error(self) -> None:
        """What a callback raised or did that the ring cannot follow, once the ring ran
        (raising mid-ring would leave the other ranks waiting)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _replay(self, step: int, call: _Call, latents: torch.Tensor) -> None:
        real = latents if call.dtype is None else latents.to(call.dtype)
        if call.legacy:
            marks = _Marks({"latents": real})
            self.legacy(call.index, call.timestep, real)
            self._refuse(marks.edited(), step, "the step callback")
            return
        given = {**call.tensors, "latents": real} if "latents" in call.tensors \
            else dict(call.tensors)
        before, guidance = dict(given), getattr(self.pipe, "_guidance_scale", None)
        marks = _Marks(given)
        out = self.on_step_end(self.pipe, call.index, call.timestep, given)
        if not isinstance(out, dict):
            raise TokpipeError(f"the step-end callback returned {type(out).__name__} at step "
                               f"{step}; diffusers' pipelines take the dict of tensors it "
                               "returns")
        changed = [repr(name) for name, value in out.items()
                   if not _unchanged(value, before.get(name, _MISSING))]
        changed += [name for name in marks.edited() if name not in changed]
        if getattr(self.pipe, "_guidance_scale", None) != guidance:
            changed.append("the guidance scale")
        self._refuse(changed, step)
        if self._interrupted():
            self.interrupted, self.interrupted_step = real, step

    def _interrupted(self) -> bool:
        """Whether the pipeline's interrupt is set (where its loop reads one)."""
        return self._interruptible and bool(getattr(self.pipe, "_interrupt", False))

    @staticmethod
    def _refuse(changed: list[str], step: int,
                callback: str = "the step-end callback") -> None:
        if changed:
            raise TokpipeError(f"{callback} changed {', '.join(changed)} at step "
                               f"{step}; the ring computed every step ahead from the first "
                               "step's form, so it cannot follow: run a callback that changes "
                               "the generation with parallelize(pipe, ring=False)")


def interruptible(pipe: Any) -> bool:
    """Whether the pipeline's loop reads an interrupt (its class's `interrupt` property):
    PixArt's, DiT's and AuraFlow's read none, and a `_interrupt` set on them does nothing."""
    return isinstance(getattr(type(pipe), "interrupt", None), property)


class _Marks:
    """Tells which of a callback's tensors it wrote in place (`latents.mul_(...)`, which
    the pipeline's own loop would go on with): by version counter, or by a copy where a
    tensor keeps none (made under inference mode)."""

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = {n: v for n, v in tensors.items() if isinstance(v, torch.Tensor)}
        self.marks = {name: _mark(value) for name, value in self.tensors.items()}

    def edited(self) -> list[str]:
        """The names of the tensors written since, quoted."""
        return [repr(name) for name, value in self.tensors.items()
                if not _same_mark(value, self.marks[name])]


def _mark(value: torch.Tensor) -> int | torch.Tensor:
    try:
        return value._version
    except RuntimeError:  # an inference tensor: no version counter
        return value.clone()


def _same_mark(value: torch.Tensor, mark: int | torch.Tensor) -> bool:
    if isinstance(mark, torch.Tensor):  # NaN where it was NaN is no write
        return torch.allclose(value, mark, rtol=0.0, atol=0.0, equal_nan=True)
    return value._version == mark


def _unchanged(value: Any, before: Any) -> bool:
    if value is before:
        return True
    return isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and \
        value.shape == before.shape and torch.equal(value, before)
