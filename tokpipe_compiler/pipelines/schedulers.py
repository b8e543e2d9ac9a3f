"""Token-wise scheduler updates for ring mode.

In ring mode the last stage applies the scheduler step to each token chunk as soon as its model
output is ready, so the step must be elementwise arithmetic that the compiler can run per
chunk. At a fixed step k, the supported diffusers schedulers' steps are linear per element in
the latents x, the model output out and the tensors the scheduler keeps between steps (its
state: UniPC's previous data predictions and corrector sample, DPM-Solver's history, ...):

    [x_next, state_next] = M_k @ [x, out, state]        (one matrix per step, per element)

`step_table` reads M_k off the real diffusers scheduler instead of re-deriving its formulas:
it steps a copy once per step on probe tensors whose last axis is the identity, so column j of
the result is the image of input j, then replays the whole loop on random tensors to check
that the table reproduces it (a step that draws noise, clamps or reduces over tokens fails
that check). `update_state` applies one row of the table. The runtime feeds
`latents * input_scale[k]` and `timesteps[k]` to the model and starts the state at zeros.

`update` and `StepTable.coeffs` keep the older fixed layout for schedulers with at most one
state tensor (DDIM, Euler, FlowMatch Euler, DPM-Solver++ up to order 2):

    x_next      = c0 * x + c1 * out + c2 * history
    new_history = c3 * x + c4 * out

Tables cover the whole schedule from its first step, as a text-to-image loop runs it; `step()`
arguments that add noise (DDIM's eta, Euler's s_churn) are taken at their zero defaults.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

K = 5  # columns of the fixed layout: x, out, history, and the history's x and out

# Schedulers whose tables are checked against diffusers' loops in the tests; others are
# accepted when their step passes the same probe and replay.
VERIFIED = (
    "UniPCMultistepScheduler",
    "FlowMatchEulerDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "DEISMultistepScheduler",
    "DDIMScheduler",
    "EulerDiscreteScheduler",
    "HeunDiscreteScheduler",
    "PNDMScheduler",
)

# Config values whose step is not token-wise linear: (option, bad values, why, what works).
NONLINEAR_OPTIONS = (
    ("thresholding", (True,), "it takes a quantile over all tokens", "False"),
    ("clip_sample", (True,), "clamping x0 is not linear", "False"),
    ("stochastic_sampling", (True,), "it draws fresh noise every step", "False"),
    ("algorithm_type", ("sde-dpmsolver", "sde-dpmsolver++"), "it draws fresh noise every step",
     "'dpmsolver++' or 'dpmsolver'"),
    ("variance_type", ("learned", "learned_range"),
     "the model output's extra channels are a variance", "None"),
)

PROBE_SHAPE = (2, 3, 4, 5)  # the replay's tensors: batch, channels and a spatial grid
REPLAY_RTOL = 1e-4  # float32 casts inside diffusers; noise or clamping misses by far more

Slot = tuple[str, int | None]  # a state tensor: attribute name, and index in a list attribute
Pattern = tuple[tuple[int, ...], ...]  # per output row, the input columns that are ever used


@dataclass(frozen=True)
class StepTable:
    """Per-step coefficients of a token-wise scheduler update, read off a diffusers scheduler.

    timesteps: [steps] float32, the model's timestep input per step.
    input_scale: [steps], model input = latents * input_scale[k] (Euler's 1/sqrt(sigma^2+1);
        1 elsewhere).
    rows: [steps, (1 + m) * (2 + m)] float32, M_k row-major: output rows x_next, state_0..,
        input columns x, out, state_0.. (m = state_size); the row `update_state` takes.
    state_size: m, the state tensors the update carries between steps.
    pattern: per output row, the input columns that are nonzero at some step (the terms
        `update_state` computes).
    scheduler: the scheduler's class name, for messages.
    """

    timesteps: torch.Tensor
    input_scale: torch.Tensor
    rows: torch.Tensor
    state_size: int
    pattern: Pattern
    scheduler: str = ""

    @property
    def history(self) -> bool:
        """Whether the update carries state (one history tensor in the fixed layout)."""
        return self.state_size > 0

    @cached_property  # frozen dataclasses allow it: it writes the instance's __dict__
    def coeffs(self) -> torch.Tensor:
        """[steps, K]: the rows in the fixed layout of `update` (module docstring)."""
        m = self.state_size
        matrix = self.rows.view(len(self.rows), 1 + m, 2 + m)
        if m > 1 or (m == 1 and matrix[:, 1, 2].any()):
            raise ValueError(f"{self.scheduler or 'this scheduler'}'s update carries {m} state "
                             "tensors, more than the one history of StepTable.coeffs; use "
                             "StepTable.rows with update_state")
        table = torch.zeros(len(self.rows), K, dtype=self.rows.dtype, device=self.rows.device)
        table[:, : 2 + m] = matrix[:, 0]
        if m:
            table[:, 3:] = matrix[:, 1, :2]
        return table


def step_table(scheduler: Any, num_inference_steps: int | None = None, device: Any = "cpu",
               **set_timesteps_kwargs: Any) -> StepTable:
    """The coefficient table of `scheduler` for `num_inference_steps` steps.

    set_timesteps_kwargs go to `scheduler.set_timesteps` as a pipeline passes them (`mu=` for
    dynamic shifting, custom `sigmas=` or `timesteps=`). Works on copies: the user's scheduler
    and the global RNG are not touched. Raises ValueError, one sentence naming the scheduler
    (and option), for a scheduler or config whose step is not token-wise linear.
    """
    _check_config(scheduler, set_timesteps_kwargs)
    args = (num_inference_steps, set_timesteps_kwargs)
    # Some steps draw noise they then scale by zero (Euler without churn): keep the user's RNG.
    with torch.random.fork_rng(devices=[]):
        sched = _fresh(scheduler, *args)
        scales, steps = _probe(sched)
        table = _assemble(sched.timesteps, scales, steps)
        _replay(_fresh(scheduler, *args), table)
    return StepTable(
        timesteps=table.timesteps.to(device=device, dtype=torch.float32),
        input_scale=table.input_scale.to(device=device, dtype=torch.float32),
        rows=table.rows.to(device=device, dtype=torch.float32),
        state_size=table.state_size,
        pattern=table.pattern,
        scheduler=type(scheduler).__name__,
    )


def update_state(
    latents: torch.Tensor,
    model_output: torch.Tensor,
    state: Sequence[torch.Tensor],
    row: torch.Tensor,
    pattern: Pattern | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One scheduler step as token-wise arithmetic, with `row` one row of StepTable.rows,
    `state` StepTable.state_size tensors shaped like the latents (zeros before the first step)
    and `pattern` StepTable.pattern (default: every term).

    Returns (x_next in latents' dtype, the new state). Like diffusers, the arithmetic runs in at
    least float32; the state stays in that precision.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)
    inputs = [t.to(dtype) for t in (latents, model_output, *state)]
    width = len(inputs)
    if pattern is None:
        pattern = tuple(tuple(range(width)) for _ in range(width - 1))
    outputs = [_combine(inputs, row[i * width:(i + 1) * width], columns)
               for i, columns in enumerate(pattern)]
    return outputs[0].to(latents.dtype), tuple(outputs[1:])


def _combine(inputs: list[torch.Tensor], weights: torch.Tensor,
             columns: Sequence[int]) -> torch.Tensor:
    """sum_j weights[j] * inputs[j] over `columns`; zeros when there are none (a state
    position that a schedule never fills)."""
    if not columns:
        return torch.zeros_like(inputs[0])
    value = weights[columns[0]] * inputs[columns[0]]
    for j in columns[1:]:
        value = value + weights[j] * inputs[j]
    return value


def update(
    latents: torch.Tensor,
    model_output: torch.Tensor,
    history: torch.Tensor | None,
    coeffs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step in the fixed layout, with `coeffs` one row of StepTable.coeffs.

    Returns (x_next in latents' dtype, new history or None when `history` is None). Like
    diffusers, the arithmetic runs in at least float32; the history stays in that precision.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)
    x = latents.to(dtype)
    out = model_output.to(dtype)
    x_next = coeffs[0] * x + coeffs[1] * out
    if history is None:
        return x_next.to(latents.dtype), None
    x_next = x_next + coeffs[2] * history.to(dtype)
    return x_next.to(latents.dtype), coeffs[3] * x + coeffs[4] * out


# --- checks -------------------------------------------------------------------------------


def unsupported(scheduler: Any, reason: str) -> ValueError:
    """The one-sentence error for a scheduler ring mode cannot take."""
    return ValueError(f"ring mode has no token-wise update for {type(scheduler).__name__}: "
                      f"{reason}; supported: {', '.join(VERIFIED)} (and any other whose step "
                      "is linear per token)")


def _check_config(scheduler: Any, kwargs: dict[str, Any]) -> None:
    name = type(scheduler).__name__
    config = getattr(scheduler, "config", None)
    if config is None or not callable(getattr(scheduler, "step", None)):
        raise unsupported(scheduler, "it is not a diffusers scheduler")
    for option, bad, why, ok in NONLINEAR_OPTIONS:
        value = config.get(option)
        if value in bad:
            raise ValueError(f"{name} option {option}={value!r} is not supported in ring mode "
                             f"({why}); supported: {option}={ok}")
    if getattr(scheduler, "solver_p", None) is not None:
        raise ValueError(f"{name} option solver_p is not supported in ring mode (its state "
                         "lives in another scheduler); supported: solver_p=None")
    if config.get("use_dynamic_shifting") and kwargs.get("mu") is None:
        raise ValueError(f"{name} option use_dynamic_shifting=True is supported in ring mode "
                         "with the pipeline's mu (from the image sequence length): pass "
                         "step_table(..., mu=mu)")


def _fresh(scheduler: Any, steps: int | None, kwargs: dict[str, Any]) -> Any:
    sched = copy.deepcopy(scheduler)
    if steps is not None:
        kwargs = {"num_inference_steps": steps, **kwargs}
    try:
        sched.set_timesteps(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{type(scheduler).__name__}.set_timesteps({_arguments(kwargs)}) "
                         f"failed: {err}") from err
    return sched


def _arguments(kwargs: dict[str, Any]) -> str:
    """The call's arguments, long ones (sigmas, timesteps) elided."""
    return ", ".join(f"{k}={v!r}" if v is None or isinstance(v, bool | int | float | str)
                     else f"{k}=..." for k, v in kwargs.items())


# --- probing ------------------------------------------------------------------------------


@dataclass
class _Step:
    """What one probe of step k saw: the state slots it read and wrote, and the image of each
    input ([x, out, *read]) in x_next and in each written slot."""

    read: list[Slot]
    written: list[Slot]
    images: torch.Tensor  # [1 + len(written), 2 + len(read)] float64


def _probe(sched: Any) -> tuple[list[float], list[_Step]]:
    """Steps `sched` through its schedule on identity probes; the input scale and the linear
    map of every step."""
    scales, steps = [], []
    for k, t in enumerate(sched.timesteps):
        read = _slots(sched)
        width = 2 + len(read)
        basis = torch.eye(width, dtype=torch.float64).reshape(width, 1, 1, 1, width)
        for slot, value in zip(read, basis[2:], strict=True):
            _set_slot(sched, slot, value.clone())
        try:
            scales.append(_input_scale(sched, t, k))
            x_next = sched.step(basis[1].clone(), t, basis[0].clone()).prev_sample
        except Exception as err:  # any failure on a probe means the step is not ours to run
            raise unsupported(sched, f"its step {k} fails on a probe tensor "
                                     f"({_first_line(err)})") from err
        written = _slots(sched)
        images = [x_next, *(_get_slot(sched, slot) for slot in written)]
        if any(image.shape != basis[0].shape for image in images):
            raise unsupported(sched, f"its step {k} changes the shape of the latents")
        steps.append(_Step(read, written, torch.stack([i.reshape(width) for i in images])))
    return scales, steps


def _input_scale(sched: Any, t: torch.Tensor, k: int) -> float:
    scale_model_input = getattr(sched, "scale_model_input", None)
    if scale_model_input is None:  # flow matching: the model input is the latents
        return 1.0
    ones = torch.ones(PROBE_SHAPE, dtype=torch.float64)
    scaled = scale_model_input(ones, t)
    if not torch.equal(scaled, torch.full_like(scaled, scaled.flatten()[0].item())):
        raise unsupported(sched, f"its model input at step {k} is not the latents times a number")
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


def _assemble(timesteps: torch.Tensor, scales: list[float], steps: list[_Step]) -> _Table:
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
                  matrices.reshape(len(steps), -1), m, pattern)


def _liveness(steps: list[_Step]) -> list[set[Slot]]:
    """live[k]: the slots read at step k whose value reaches some later x_next (live[n] is
    empty: nothing after the last step)."""
    live: list[set[Slot]] = [set() for _ in range(len(steps) + 1)]
    for k in range(len(steps) - 1, -1, -1):
        step = steps[k]
        rows = [0] + [1 + i for i, slot in enumerate(step.written) if slot in live[k + 1]]
        used = step.images[rows, 2:].ne(0).any(dim=0)
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


def _replay(sched: Any, table: _Table) -> None:
    """Runs the scheduler's own loop on random latents and model outputs next to the table's
    recurrence; a table that misses it means the step is not token-wise linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_SHAPE, generator=gen, dtype=torch.float64)
    mine, state = x, tuple(torch.zeros_like(x) for _ in range(table.state_size))
    for k, t in enumerate(sched.timesteps):
        out = torch.randn(PROBE_SHAPE, generator=gen, dtype=torch.float64)
        scale = getattr(sched, "scale_model_input", None)
        # as a pipeline calls it (Euler checks that it was)
        if scale is not None and not torch.allclose(scale(x, t), x * table.input_scale[k],
                                                    rtol=REPLAY_RTOL, atol=0):
            raise unsupported(sched, f"its model input at step {k} is not the latents times "
                                     "a number")
        try:
            x = sched.step(out, t, x).prev_sample.to(torch.float64)
        except Exception as err:
            raise unsupported(sched, f"its step {k} fails on random latents "
                                     f"({_first_line(err)})") from err
        if not x.isfinite().all():
            raise unsupported(sched, f"its own step {k} returns NaN or inf for this config "
                                     "(e.g. a final sigma of zero that it divides by)")
        mine, state = update_state(mine, out, state, table.rows[k], table.pattern)
        error = (mine - x).abs().max() / x.abs().max().clamp(min=1e-30)
        if not error <= REPLAY_RTOL:  # not <=: NaN fails too
            raise unsupported(sched, f"its step {k} is not linear per token (it draws noise, "
                                     "clamps, or mixes tokens)")
