"""What a Ring run is given: the carried names and per-step inputs checked, the step's
returned values matched to the carried names, and the input signature a traced step is
specialised to (another signature traces the step anew)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokpipe_compiler.core.autocast import autocast_state
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.planning.capture import Captured
from tokpipe_compiler.planning.returned_values import COMPUTED, CONTAINER, INPUT, Returned

ONE_PER_CARRY = ("A ring feeds each returned tensor back as the carried input of its place "
                 "and returns those: return a tuple of tensors, one per name in carry, in "
                 "carry order (a multistep solver's history too), or a dict of them by name; "
                 "to look at the latents after each step, pass each_step= to run")


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


def check_returns(traced: Captured, carry: Sequence[str], values: dict[str, Any]) -> None:
    """Raises where the traced step's return does not feed `carry`: by place (or key), and
    each carried value in the shape it came in (the stages are planned for that shape)."""
    if traced.returned is None:  # Dynamo did not say: the program's outputs are counted
        return
    outputs = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    for name, feed in zip(carry, feeds_of(traced.returned, carry), strict=True):
        given, made = values.get(name), None if feed is None else example_value(outputs[feed])
        if isinstance(given, torch.Tensor) and isinstance(made, torch.Tensor) and \
                tuple(given.shape) != tuple(made.shape):
            raise TokpipeError(f"carried input {name!r} is passed in shape "
                               f"{tuple(given.shape)} but the step returns it in shape "
                               f"{tuple(made.shape)}: a ring feeds each step's value to the "
                               "next in place, chunk by chunk, so a carried value keeps its "
                               "shape (change resolution between rings, not inside one)")


def feeds_of(returned: tuple[Returned, ...], carry: Sequence[str]) -> list[int | None]:
    """For each carried name, the graph output its next value is, or None where the step
    returns that input unchanged; raises where the return does not match `carry`. A dict
    returned is matched by key, anything else by place."""
    tensors = _carried_returns(returned, carry)
    feeds: list[int | None] = []
    for name, value in zip(carry, tensors, strict=True):
        if value.kind == INPUT and value.source != name:
            raise TokpipeError(f"the step function returns its input {value.source!r} "
                               f"unchanged as the next {name!r}: a ring carries each value "
                               f"chunk by chunk from the step that computes it; return "
                               f"{value.source}.clone() there")
        feeds.append(None if value.kind == INPUT else value.output)
    if feeds[0] is None:
        raise TokpipeError(f"the step function returns {carry[0]!r}, the token input a ring "
                           "chunks (carry's first name), unchanged: a ring needs a step that "
                           "computes its next value")
    return feeds


def _carried_returns(returned: tuple[Returned, ...], carry: Sequence[str]) -> list[Returned]:
    """The returned tensor of each carried name, in carry order."""
    said = ", ".join(r.describe() for r in returned)
    tensors = [r for r in returned if r.kind in (COMPUTED, INPUT)]
    if any(r.kind == CONTAINER for r in returned):
        raise TokpipeError(f"the step function returns {said}: a ring takes tensors at the "
                           f"top of the return only. {ONE_PER_CARRY}")
    if returned and returned[0].key is not None:  # a dict
        keys = {r.key for r in tensors}
        if keys != set(carry):
            raise TokpipeError(f"the step function returns a dict of {said}; carry names "
                               f"{list(carry)}: return a tensor under each carried name and "
                               f"no other tensors (the ring returns the carried ones)")
        return [next(r for r in tensors if r.key == name) for name in carry]
    if len(tensors) != len(carry):
        raise TokpipeError(f"the step function returns {len(returned)} value(s): {said}; "
                           f"carry names {len(carry)}: {list(carry)}. {ONE_PER_CARRY}")
    return tensors


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
    return (*sorted((name, _value_key(v)) for name, v in values.items()), autocast_state())


def _value_key(value: Any, depth: int = 0) -> Any:
    """A value as a traced step is specialised to it. An object's attributes count (a step
    reading `settings.guidance` traces it as a constant), a few levels deep; modules and
    other callables by identity (`traced_modules` follows what modules hold)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_value_key(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _value_key(v, depth + 1))
                                     for k, v in value.items())))
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
