"""Reading a scheduler's step matrices off the diffusers scheduler itself (`step_table`).

Each step is stepped once on probe tensors whose last axis is the identity, so column j of
every output (the next sample, each state tensor the step writes) is the image of input j.
The state slots are found on the scheduler (tensors and lists of tensors it keeps), dead
ones dropped and the live ones packed into as few positions as the schedule needs; a replay
of the scheduler's own loop on random tensors then checks the assembled table.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from tokpipe_compiler.pipelines.drawn_noise import drawn_noise
from tokpipe_compiler.pipelines.step_rows import Pattern, update_state

PROBE_SHAPE = (2, 3, 4, 5)  # the replay's tensors: batch, channels and a spatial grid
REPLAY_RTOL = 1e-4  # float32 casts inside diffusers; noise or clamping misses by far more

Slot = tuple[str, int | None]  # a state tensor: attribute name, and index in a list attribute


class NotTokenWise(ValueError):
    """Why a scheduler's step is not linear per token (step_table names the scheduler)."""


class ProbeFailed(NotTokenWise):
    """A step that raised on its probe; `scales` and `steps`: what the steps before it
    showed, so that a replay of those can tell a likelier reason (a step that draws noise
    and reads a schedule entry past the loop's end fails first on the entry)."""

    def __init__(self, message: str, scales: list[float], steps: list[_Step]):
        super().__init__(message)
        self.scales, self.steps = scales, steps


# --- probing ------------------------------------------------------------------------------


@dataclass
class _Step:
    """What one probe of step k saw: the state slots it read and wrote, and the image of each
    input ([x, out, *read, the noise it draws]) in x_next and in each written slot."""

    read: list[Slot]
    written: list[Slot]
    images: torch.Tensor  # [1 + len(written), 3 + len(read)] float64

    @property
    def noise(self) -> float:
        """The scale of the drawn noise in x_next."""
        return self.images[0, -1].item()


def probe_steps(sched: Any, begin: int = 0) -> tuple[list[float], list[_Step]]:
    """Steps `sched` through its schedule from step `begin` on identity probes; the input
    scale and the linear map of every step."""
    _check_step_arguments(sched)
    scales, steps = [], []
    for k, t in enumerate(sched.timesteps[begin:]):
        read = _slots(sched)
        width = 3 + len(read)  # x, out, the state read, the noise drawn
        basis = torch.eye(width, dtype=torch.float64).reshape(width, 1, 1, 1, width)
        for slot, value in zip(read, basis[2:-1], strict=True):
            _set_slot(sched, slot, value.clone())
        try:
            scales.append(_input_scale(sched, t, k))
            with drawn_noise(sched, lambda _shape, _kwargs, n=basis[-1]: n.clone()) as drawn:
                x_next = sched.step(basis[1].clone(), t, basis[0].clone()).prev_sample
        except Exception as err:  # any failure on a probe means the step is not ours to run
            raise ProbeFailed(f"its step {k} fails on a probe tensor ({_first_line(err)})",
                              scales, steps) from err
        written = _slots(sched)
        images = [x_next, *(_get_slot(sched, slot) for slot in written)]
        if any(image.shape != basis[0].shape for image in images):
            raise NotTokenWise(f"its step {k} changes the shape of the latents")
        step = _Step(read, written, torch.stack([i.reshape(width) for i in images]))
        if not drawn:  # no noise column, even where the step's NaN spread to it
            step.images[:, -1] = 0
        elif len(drawn) > 1 or step.images[1:, -1].any():
            raise NotTokenWise(f"its step {k} draws noise more than once, or keeps it")
        steps.append(step)
    return scales, steps


STEP_ARGUMENTS = ("model_output", "timestep", "sample")  # what the ring's step passes


def _check_step_arguments(sched: Any) -> None:
    """A step that needs more than the model output, timestep and sample (CogVideoX's DPM
    step takes the last x0 and the timestep back) is not one the ring replays: said so,
    not as the TypeError a probe call would raise."""
    try:
        parameters = inspect.signature(sched.step).parameters.values()
    except (TypeError, ValueError):
        return
    extra = [p.name for p in parameters if p.default is p.empty and p.name not in STEP_ARGUMENTS
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if extra:
        raise NotTokenWise(f"its step needs {', '.join(extra)} besides the model output, "
                           "timestep and sample, which is all the ring's step passes")


def _input_scale(sched: Any, t: torch.Tensor, k: int) -> float:
    scale_model_input = getattr(sched, "scale_model_input", None)
    if scale_model_input is None:  # flow matching: the model input is the latents
        return 1.0
    ones = torch.ones(PROBE_SHAPE, dtype=torch.float64)
    scaled = scale_model_input(ones, t)
    if not torch.equal(scaled, torch.full_like(scaled, scaled.flatten()[0].item())):
        raise NotTokenWise(f"its model input at step {k} is not the latents times a number")
    return scaled.flatten()[0].item()


def _first_line(err: Exception) -> str:
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _slots(sched: Any) -> list[Slot]:
    """The scheduler's state tensors: attributes (or list items) shaped like the probe (the
    scheduler kept them from earlier probe inputs)."""
    found: list[Slot] = []
    for name, value in vars(sched).items():
        if _is_probed(value):
            found.append((name, None))
        elif isinstance(value, list | tuple):
            found += [(name, i) for i, item in enumerate(value) if _is_probed(item)]
    return found


def _is_probed(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[:3] == (1, 1, 1)


def _get_slot(sched: Any, slot: Slot) -> torch.Tensor:
    name, index = slot
    value = getattr(sched, name)
    return value if index is None else value[index]


def _set_slot(sched: Any, slot: Slot, tensor: torch.Tensor) -> None:
    name, index = slot
    if index is None:
        setattr(sched, name, tensor)
        return
    old = getattr(sched, name)
    if isinstance(old, list):
        old[index] = tensor  # in place: the scheduler may hold other references to the list
    else:
        setattr(sched, name, (*old[:index], tensor, *old[index + 1:]))


# --- assembling the table -----------------------------------------------------------------


@dataclass
class _Table:
    timesteps: torch.Tensor
    input_scale: torch.Tensor
    rows: torch.Tensor  # float64
    state_size: int
    pattern: Pattern
    noise: torch.Tensor  # [steps] float64: the scale of each step's drawn noise


def assemble(timesteps: torch.Tensor, scales: list[float], steps: list[_Step]) -> _Table:
    """Dense per-step matrices over the live slots, each live slot given a position in the
    carried state (positions are reused once a slot is dead, so a growing history list such
    as PNDM's carries only what later steps read)."""
    live = _liveness(steps)
    positions = _allocate(live)
    m = max((len(p) for p in positions), default=0)
    matrices = torch.zeros(len(steps), 1 + m, 2 + m, dtype=torch.float64)
    for k, step in enumerate(steps):
        columns = [0, 1] + [2 + positions[k][slot] for slot in step.read if slot in live[k]]
        kept = [0, 1] + [2 + i for i, slot in enumerate(step.read) if slot in live[k]]
        out_rows = [(0, 0)] + [(1 + positions[k + 1][slot], 1 + i)
                               for i, slot in enumerate(step.written) if slot in live[k + 1]]
        for row, image_row in out_rows:
            matrices[k, row, columns] = step.images[image_row, kept]
    pattern = tuple(tuple(int(j) for j in torch.nonzero(matrices[:, i].any(dim=0)).flatten())
                    for i in range(1 + m))
    return _Table(timesteps.to(torch.float64), torch.tensor(scales, dtype=torch.float64),
                  matrices.reshape(len(steps), -1), m, pattern,
                  torch.tensor([step.noise for step in steps], dtype=torch.float64))


def _liveness(steps: list[_Step]) -> list[set[Slot]]:
    """live[k]: the slots read at step k whose value reaches some later x_next (live[n] is
    empty: nothing after the last step)."""
    live: list[set[Slot]] = [set() for _ in range(len(steps) + 1)]
    for k in range(len(steps) - 1, -1, -1):
        step = steps[k]
        rows = [0] + [1 + i for i, slot in enumerate(step.written) if slot in live[k + 1]]
        used = step.images[rows, 2:-1].ne(0).any(dim=0)  # the noise drawn is no slot
        live[k] = {slot for slot, u in zip(step.read, used.tolist(), strict=True) if u}
    return live


def _allocate(live: list[set[Slot]]) -> list[dict[Slot, int]]:
    """A state position for each live slot at each step boundary: a slot that stays live keeps
    its position (sparser tables), a new one takes the lowest free position."""
    positions: list[dict[Slot, int]] = []
    previous: dict[Slot, int] = {}
    for slots in live:
        current = {slot: previous[slot] for slot in slots if slot in previous}
        free = (i for i in range(len(slots) + len(previous)) if i not in current.values())
        for slot in sorted(slots - current.keys(), key=str):
            current[slot] = next(free)
        positions.append(current)
        previous = current
    return positions


# --- replay -------------------------------------------------------------------------------


def replay(sched: Any, table: _Table, begin: int = 0) -> None:
    """Runs the scheduler's own loop on random latents and model outputs next to the table's
    recurrence (the table's steps from `begin`); a table that misses it means the step is not
    token-wise linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_SHAPE, generator=gen, dtype=torch.float64)
    mine, state = x, tuple(torch.zeros_like(x) for _ in range(table.state_size))
    for k, t in enumerate(sched.timesteps[begin:begin + len(table.rows)]):
        out = torch.randn(PROBE_SHAPE, generator=gen, dtype=torch.float64)
        scale = getattr(sched, "scale_model_input", None)
        # as a pipeline calls it (Euler checks that it was)
        if scale is not None and not torch.allclose(scale(x, t), x * table.input_scale[k],
                                                    rtol=REPLAY_RTOL, atol=0):
            raise NotTokenWise(f"its model input at step {k} is not the latents times "
                                     "a number")
        try:
            with drawn_noise(sched) as drawn:
                x = sched.step(out, t, x).prev_sample.to(torch.float64)
        except Exception as err:
            raise NotTokenWise(f"its step {k} fails on random latents "
                                     f"({_first_line(err)})") from err
        if not x.isfinite().all():
            raise NotTokenWise(f"its own step {k} returns NaN or inf for this config "
                                     "(e.g. a final sigma of zero that it divides by)")
        mine, state = update_state(mine, out, state, table.rows[k], table.pattern)
        if drawn:  # one draw at most: the probes said so
            mine = mine + table.noise[k] * drawn[0].to(torch.float64)
        error = (mine - x).abs().max() / x.abs().max().clamp(min=1e-30)
        if not error <= REPLAY_RTOL:  # not <=: NaN fails too
            raise NotTokenWise(f"its step {k} is not linear per token (it draws noise, "
                                     "clamps, or mixes tokens)")
