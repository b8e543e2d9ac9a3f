"""What a Ring run is given: the carried names and per-step inputs checked, and the input
signature a traced step is specialised to (another signature traces the step anew)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokpipe_compiler.core.autocast import autocast_state
from tokpipe_compiler.core.errors import TokpipeError


def carry_names(carry: Sequence[str]) -> list[str]:
    if isinstance(carry, str):
        carry = [carry]
    names = list(carry)
    if not names:
        raise TokpipeError("Ring needs carry=[...] to name at least one input the step "
                           "function's outputs feed back, e.g. carry=['latents']")
    bad = [name for name in names if not isinstance(name, str)]
    if bad or len(set(names)) != len(names):
        raise TokpipeError(f"Ring's carry must name distinct inputs by name, got {names!r}")
    return names


def check_carried_inputs(inputs: dict[str, Any], carry: Sequence[str]) -> None:
    """A first value for each carried name, each its own tensor: a ring carries each
    chunk by chunk into its own buffer, and a trace of one tensor passed under two names
    reads it as one input."""
    missing = [name for name in carry if name not in inputs]
    if missing:
        raise TokpipeError(f"Ring.run needs a first value for carried input(s) {missing}")
    for name, value in inputs.items():
        same = [c for c in carry if c != name and inputs[c] is value
                and (name not in carry or carry.index(c) < carry.index(name))]
        if same:
            what = "carried inputs" if name in carry else "the carried input and input"
            raise TokpipeError(f"Ring.run: {what} {same[0]!r} and {name!r} are one tensor; "
                               f"pass a copy as {name!r} ({name}={same[0]}.clone())")


def check_per_step(per_step: dict[str, Any], carry: Sequence[str]) -> None:
    """Per-step inputs are tensors indexed by step, none of them carried. A list of floats
    would be traced as its first value, a constant, at every step."""
    for name, value in per_step.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise TokpipeError(
                f"Ring.run: per-step input {name!r} must be a tensor with one entry per step "
                f"(dim 0), got {type(value).__name__}"
                f"{'' if not isinstance(value, torch.Tensor) else ' of 0 dimensions'}; pass "
                f"torch.tensor(...) of it (a step traced with a Python number holds its "
                "first value as a constant)")
    carried = [name for name in carry if name in per_step]
    if carried:
        raise TokpipeError(f"Ring.run: {carried} are carried (each step's value is the last "
                           "step's output) and given per step too; give their first value "
                           "in `inputs` only")


def check_steps(steps: int | None, per_step: dict[str, torch.Tensor]) -> int:
    """`steps`, or the per-step tensors' common length; an error if some are too short."""
    if steps is None:
        if not per_step:
            raise TokpipeError("Ring.run needs steps=... or per-step inputs to count them")
        return _steps_of(per_step)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise TokpipeError(f"Ring.run: steps must be an int >= 0, got {steps!r}")
    short = {name: len(v) for name, v in per_step.items() if len(v) < steps}
    if short:
        raise TokpipeError(f"Ring.run: steps={steps} but per-step input(s) hold fewer values: "
                           f"{short}; pass one value per step, or fewer steps")
    return steps


def input_signature(values: dict[str, Any]) -> tuple:
    """What a traced step is specialised to: each tensor's shape, dtype and device, the
    value of anything else (the trace holds those as constants: a settings object's by its
    attributes), and the autocast state (it sets the dtypes of the values, caches and
    messages a plan allocates)."""
    return (*sorted((name, _value_key(v)) for name, v in values.items()), autocast_state(),
            _aliases(values))


def _aliases(values: dict[str, Any]) -> tuple:
    """Which inputs are one tensor passed under several names: the trace reads it as one
    input, so another run passing them apart traces anew."""
    names = sorted(n for n, v in values.items() if isinstance(v, torch.Tensor))
    return tuple((name, next(o for o in names if values[o] is values[name]))
                 for name in names if any(values[o] is values[name] for o in names if o < name))


def _value_key(value: Any, depth: int = 0) -> Any:
    """A value as a traced step is specialised to it. An object's attributes count (a step
    reading `settings.guidance` traces it as a constant), a few levels deep; modules and
    other callables by identity (`traced_modules` follows what modules hold)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_value_key(v, depth + 1) for v in value))
    if isinstance(value, dict):  # in order: a trace reads some entries by their place
        return ("dict", tuple((repr(k), _value_key(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, torch.nn.Module) or callable(value) or depth >= 3 or \
            not hasattr(value, "__dict__"):  # a function (a class) by identity, not its attributes
        return repr(value)
    return (type(value).__qualname__, tuple(sorted(
        (name, _value_key(v, depth + 1)) for name, v in vars(value).items())))


def _steps_of(per_step: dict[str, torch.Tensor]) -> int:
    lengths = {len(v) for v in per_step.values()}
    if len(lengths) != 1:
        raise TokpipeError("pass steps=..., or per-step inputs of one common length; got "
                           f"lengths {sorted(lengths)}")
    return lengths.pop()
