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
that the table reproduces it (a step that clamps or reduces over tokens fails that check).
A step that draws noise with `randn_tensor` gets one more basis column for its draw
(`drawn_noise`), whose image is the noise's scale: `step_table(noise=True)` returns it as
`StepTable.noise`, for a caller that draws the noise as the step would and adds it.
`update_state` applies one row of the table. The runtime feeds
`latents * input_scale[k]` and `timesteps[k]` to the model and starts the state at zeros.

`update` and `StepTable.coeffs` keep the older fixed layout for schedulers with at most one
state tensor (DDIM, Euler, FlowMatch Euler, DPM-Solver++ up to order 2):

    x_next      = c0 * x + c1 * out + c2 * history
    new_history = c3 * x + c4 * out

Tables cover the schedule from the step the loop starts at (the first, or an image-to-image
pipeline's begin index); `step()`
arguments that add noise (DDIM's eta, Euler's s_churn) are taken at their zero defaults.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tokpipe_compiler.pipelines.scheduler_probe import (
    NotTokenWise,
    ProbeFailed,
    assemble,
    probe_steps,
    replay,
)
from tokpipe_compiler.pipelines.step_rows import Pattern, update_state

__all__ = ["VERIFIED", "K", "StepTable", "step_table", "unsupported", "update", "update_state"]

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
    "FlowMatchHeunDiscreteScheduler",
    "PNDMScheduler",
)

# Config values whose step is not token-wise linear: (option, values a ring cannot take,
# why, what it can take, one value it can take).
NONLINEAR_OPTIONS = (
    ("thresholding", (True,), "it takes a quantile over all tokens", "False", False),
    ("clip_sample", (True,), "clamping x0 is not linear", "False", False),
    ("stochastic_sampling", (True,), "it draws fresh noise every step", "False", False),
    ("algorithm_type", ("sde-dpmsolver", "sde-dpmsolver++"), "it draws fresh noise every step",
     "'dpmsolver++' or 'dpmsolver'", "dpmsolver++"),
    ("variance_type", ("learned", "learned_range"),
     "the model output's extra channels are a variance", "None", None),
)


# Of those, the options whose noise a caller that adds each step's draw takes
# (`step_table(noise=True)`): SDE-DPM-Solver draws it with `randn_tensor`, from the step's
# generator (stochastic_sampling draws it with `torch.randn_like`, from none).
NOISE_OPTIONS = ("algorithm_type",)


class UnsupportedOption(ValueError):
    """A scheduler option a ring cannot take; `allowed`: the config with one it can."""

    def __init__(self, message: str, allowed: dict[str, Any]):
        super().__init__(message)
        self.allowed = allowed


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
    noise: [steps] float32, the scale of the noise step k draws (`drawn_noise`), added to
        x_next; None for a table of steps that draw none (`step_table(noise=False)`).
    """

    timesteps: torch.Tensor
    input_scale: torch.Tensor
    rows: torch.Tensor
    state_size: int
    pattern: Pattern
    scheduler: str = ""
    noise: torch.Tensor | None = None

    @property
    def history(self) -> bool:
        """Whether the update carries state (one history tensor in the fixed layout)."""
        return self.state_size > 0

    def steps(self, begin: int, end: int | None = None) -> StepTable:
        """The table of steps begin..end-1 (a part of the loop one transformer takes)."""
        part = slice(begin, end)
        noise = None if self.noise is None else self.noise[part]
        return dataclasses.replace(self, timesteps=self.timesteps[part],
                                   input_scale=self.input_scale[part], rows=self.rows[part],
                                   noise=noise)

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
               begin_index: int = 0, noise: bool = False,
               **set_timesteps_kwargs: Any) -> StepTable:
    """The coefficient table of `scheduler` for `num_inference_steps` steps.

    begin_index: the step the loop starts at (image-to-image pipelines loop over the rest of
    the schedule, most after `scheduler.set_begin_index`); the table covers the steps from
    there, as the scheduler takes them (a multistep scheduler starts its history there).
    set_timesteps_kwargs go to `scheduler.set_timesteps` as a pipeline passes them (`mu=` for
    dynamic shifting, custom `sigmas=` or `timesteps=`). noise: a step may draw noise (DDPM,
    Euler ancestral), whose scale the table's `noise` holds, for a caller that draws it as
    the scheduler would and adds it. Works on copies: the user's scheduler
    and the global RNG are not touched. Raises ValueError, one sentence naming the scheduler
    (and option), for a scheduler or config whose step is not token-wise linear.
    """
    try:
        _check_config(scheduler, set_timesteps_kwargs, noise)
    except UnsupportedOption as err:
        otherwise = _unsupported_otherwise(scheduler, err.allowed, num_inference_steps,
                                           begin_index, {**set_timesteps_kwargs,
                                                         "noise": noise})
        raise ValueError(f"{err}{otherwise}") from None
    args = (num_inference_steps, begin_index, set_timesteps_kwargs)
    # Some steps draw noise they then scale by zero (Euler without churn): keep the user's RNG.
    with torch.random.fork_rng(devices=[]):
        try:
            table = _checked_table(scheduler, args, noise)
        except NotTokenWise as err:
            raise unsupported(scheduler, str(err)) from None
    return StepTable(
        timesteps=table.timesteps.to(device=device, dtype=torch.float32),
        input_scale=table.input_scale.to(device=device, dtype=torch.float32),
        rows=table.rows.to(device=device, dtype=torch.float32),
        state_size=table.state_size,
        pattern=table.pattern,
        scheduler=type(scheduler).__name__,
        noise=table.noise.to(device=device, dtype=torch.float32) if table.noise.any() else None,
    )


def _checked_table(scheduler: Any, args: tuple[Any, ...], noise: bool) -> Any:
    """The table probed off a fresh copy of `scheduler`, checked by replaying another's
    loop (and refused where a step draws noise and `noise` is False). A step that fails on
    its probe has the steps before it replayed first: a step that draws noise says so
    there, before it fails reading past the schedule's end."""
    begin = args[1]
    sched = _fresh(scheduler, *args)
    try:
        scales, steps = probe_steps(sched, begin)
    except ProbeFailed as failed:
        _replay(scheduler, args, sched.timesteps[begin:], failed.scales, failed.steps, noise)
        raise
    return _replay(scheduler, args, sched.timesteps[begin:], scales, steps, noise)


def _replay(scheduler: Any, args: tuple[Any, ...], timesteps: torch.Tensor,
            scales: list[float], steps: list[Any], noise: bool) -> Any:
    """The table the probed steps make, checked by replaying a fresh copy's loop over them."""
    table = assemble(timesteps[: len(steps)], scales, steps)
    drawing = torch.nonzero(table.noise).flatten().tolist()
    if drawing and not noise:
        raise NotTokenWise(f"its step {drawing[0]} draws noise")
    replay(_fresh(scheduler, *args), table, args[1])
    return table


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


def _check_config(scheduler: Any, kwargs: dict[str, Any], noise: bool) -> None:
    name = type(scheduler).__name__
    config = getattr(scheduler, "config", None)
    if config is None or not callable(getattr(scheduler, "step", None)):
        raise unsupported(scheduler, "it is not a diffusers scheduler")
    for option, bad, why, ok, ok_value in NONLINEAR_OPTIONS:
        if noise and option in NOISE_OPTIONS:
            continue
        value = config.get(option)
        if value in bad and _reads(scheduler, option):
            raise UnsupportedOption(f"{name} option {option}={value!r} is not supported in "
                                    f"ring mode ({why}); supported: {option}={ok}",
                                    {option: ok_value})
    if getattr(scheduler, "solver_p", None) is not None:
        raise ValueError(f"{name} option solver_p is not supported in ring mode (its state "
                         "lives in another scheduler); supported: solver_p=None")
    if config.get("use_dynamic_shifting") and kwargs.get("mu") is None:
        raise ValueError(f"{name} option use_dynamic_shifting=True is supported in ring mode "
                         "with the pipeline's mu (from the image sequence length): pass "
                         "step_table(..., mu=mu)")


def _unsupported_otherwise(scheduler: Any, options: dict[str, Any], steps: int | None,
                           begin_index: int, step_table_kwargs: dict[str, Any]) -> str:
    """Why a ring cannot take `scheduler` with `options` set as a ring needs them (the
    public table refuses DDPM's noise whatever its clip_sample), as the end of the option's
    refusal; '' where it can."""
    try:
        allowed = type(scheduler).from_config(scheduler.config, **options)
        if any(allowed.config.get(option) != value for option, value in options.items()):
            return ""  # the option did not take: nothing more is known
        step_table(allowed, steps, begin_index=begin_index, **step_table_kwargs)
    except Exception as other:  # any reason it fails is the user's next one
        return f"; but not with that either: {other}"
    return ""


def _reads(scheduler: Any, option: str) -> bool:
    """Whether the scheduler's methods read config `option` as an attribute (`self.config.
    clip_sample`; CogVideoXDPMScheduler carries clip_sample=True in its config and never
    clamps); True where the source is unknown."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(scheduler))))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(node, ast.Attribute) and node.attr == option
               for node in ast.walk(tree))


def _fresh(scheduler: Any, steps: int | None, begin_index: int, kwargs: dict[str, Any]) -> Any:
    sched = copy.deepcopy(scheduler)
    for name, value in list(vars(sched).items()):  # `add_noise` moves some tables to the GPU
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            setattr(sched, name, value.cpu())
    if steps is not None:
        kwargs = {"num_inference_steps": steps, **kwargs}
    try:
        sched.set_timesteps(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{type(scheduler).__name__}.set_timesteps({_arguments(kwargs)}) "
                         f"failed: {err}") from err
    if begin_index and hasattr(sched, "set_begin_index"):
        # a scheduler without one finds its step from the timestep (DDIM needs none)
        sched.set_begin_index(begin_index)
    return sched


def _arguments(kwargs: dict[str, Any]) -> str:
    """The call's arguments, long ones (sigmas, timesteps) elided."""
    return ", ".join(f"{k}={v!r}" if v is None or isinstance(v, bool | int | float | str)
                     else f"{k}=..." for k, v in kwargs.items())
