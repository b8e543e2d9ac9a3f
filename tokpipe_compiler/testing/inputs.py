"""The inputs `assert_equivalent` makes from the given one: another input of the same
shapes (a new generation's), the same input at a later step, and a guidance branch's.

A timestep moves by whole steps where it is an integer (an index into a table, kept
within [0, the given value] or above it) and by a hundredth of itself where it is a float
(toward zero, so a log-sigma stays defined). Only inputs that look like data change: float
tensors of rank >= 3, finite, with more than two distinct values (latents, text; not an
additive mask of 0 and -inf, whose negation would show what it hides).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tokpipe_compiler.stage_programs.generations import timestep_names

Inputs = tuple[tuple, dict]  # args, kwargs


def other_input(model: torch.nn.Module, args: tuple, kwargs: dict,
                timestep_input: str | int | None = None) -> Inputs:
    """Another input of the same shapes: its data tensors changed, a timestep tensor moved
    by one step (so the given input's first call is the next step, not another guidance
    branch at the same timestep). Python numbers stay."""
    return changed_input(model, args, kwargs, timestep_input, steps=1, tokens=True, span=1)


def changed_input(model: torch.nn.Module, args: tuple, kwargs: dict,
                  timestep_input: str | int | None, steps: int, tokens: bool,
                  span: int) -> Inputs:
    """The given input with its timestep tensor moved by `steps` steps (`_moved`; `span`:
    the most steps any input of the sequence moves, which sets the direction) and, where
    `tokens`, its data tensors changed (another branch's or generation's)."""
    signature = inspect.signature(model.forward)
    signature.bind(*args, **kwargs)  # a call the forward takes
    names = timestep_names(timestep_input if isinstance(timestep_input, str) else None)
    position = timestep_input if isinstance(timestep_input, int) else None

    def changed(value: Any, timestep: bool) -> Any:
        if isinstance(value, dict):  # a conditioning dict: its entries by their keys
            return {key: changed(v, key in names) for key, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        if timestep:
            return _moved(value, steps, span)
        return 0.25 - value if tokens and _is_data(value) else value

    # Passed as given, by position or keyword: Dynamo guards on how (another form of the
    # call is traced again, with a warning).
    moved_args: list[Any] = []
    for name, value in signature.bind_partial(*args).arguments.items():
        if signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL:
            moved_args += [changed(v, i == position) for i, v in enumerate(value)]
        else:
            moved_args.append(changed(value, name in names))
    return tuple(moved_args), {key: changed(v, key in names) for key, v in kwargs.items()}


def _moved(t: torch.Tensor, steps: int, span: int) -> torch.Tensor:
    """`t` moved by `steps` steps of a sequence of up to `span`, all in one direction:
    integers by 1 a step (down where the sequence stays >= 0, else up), floats by a
    hundredth of themselves toward zero."""
    if not steps or t.numel() == 0:
        return t
    first = t.flatten()[0].item()
    if not t.is_floating_point():
        return t - steps if first - span >= 0 else t + steps
    step = 0.01 * abs(first) if first else 1e-3
    return t - steps * step * (1 if first >= 0 else -1)


def _is_data(value: torch.Tensor) -> bool:
    """A float tensor of rank >= 3 with finite values, more than two distinct ones: the
    latents or text, not a mask."""
    if not value.is_floating_point() or value.dim() < 3 or not bool(value.isfinite().all()):
        return False
    return value.flatten()[:4096].unique().numel() > 2
