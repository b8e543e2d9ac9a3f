"""The inputs `assert_equivalent` makes from the given one: another input of the same
shapes (a new generation's), the same input at a later step, and a guidance branch's."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tokpipe_compiler.programs.generations import timestep_names

Inputs = tuple[tuple, dict]  # args, kwargs


def other_input(model: torch.nn.Module, args: tuple, kwargs: dict,
                timestep_input: str | int | None = None) -> Inputs:
    """Another input of the same shapes: floating tensors of rank >= 3 (latents, text)
    changed, a timestep tensor moved by one (so the given input's first call is the next
    step, not another guidance branch at the same timestep). Python numbers stay."""
    return changed_input(model, args, kwargs, timestep_input, shift=1, tokens=True)


def changed_input(model: torch.nn.Module, args: tuple, kwargs: dict,
                  timestep_input: str | int | None, shift: int, tokens: bool) -> Inputs:
    """The given input with its timestep tensor moved by `shift` and, where `tokens`, its
    floating tensors of rank >= 3 changed (another branch's or generation's)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    timesteps = timestep_names(timestep_input if isinstance(timestep_input, str) else None)
    changed = _changer(shift, tokens)
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:  # **kwargs: each by its keyword
            value = {key: changed(v, key in timesteps) for key, v in value.items()}
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            value = tuple(changed(v, i == timestep_input) for i, v in enumerate(value))
        else:
            value = changed(value, name in timesteps)
        bound.arguments[name] = value
    return bound.args, bound.kwargs


def _changer(shift: int, tokens: bool):
    def changed(value: Any, timestep: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if timestep:
            return value + shift if shift else value
        if tokens and value.is_floating_point() and value.dim() >= 3:
            return 0.25 - value
        return value

    return changed
