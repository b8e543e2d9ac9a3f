"""The plain attributes of a model's modules (not parameters, buffers or submodules), and of
the plain objects they hold: where a model keeps what it fills at its first call (Z-Image's
rotary table in `rope_embedder.freqs_cis`, its embedder no module)."""

from __future__ import annotations

import types
from typing import Any

import torch

Attributes = list[tuple[Any, dict[str, Any]]]  # each owner, and its attributes then


def plain_attributes(module: Any) -> Attributes:
    """Each module's and held plain object's attributes, as they are now ([] for a
    non-module)."""
    if not isinstance(module, torch.nn.Module):
        return []
    owners: list[Any] = []
    for owner in module.modules():
        owners.append(owner)
        owners.extend(value for value in owner.__dict__.values() if _plain_object(value))
    return [(owner, dict(vars(owner))) for owner in owners]


def attributes_changed(attributes: Attributes) -> bool:
    """Whether any attribute now holds another object than it did (a cache filled)."""
    return any(value is not before.get(name, object())
               for owner, before in attributes for name, value in vars(owner).items())


def _plain_object(value: Any) -> bool:
    """An instance of a Python class with attributes of its own: not a module, tensor,
    class, function or container."""
    return hasattr(value, "__dict__") and not isinstance(
        value, torch.nn.Module | torch.Tensor | type | types.FunctionType | types.MethodType
        | types.ModuleType)
