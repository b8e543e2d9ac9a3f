"""Programs belong to the model whose weights they run.

Dynamo serves two instances of one class with one compiled graph (their weights are graph
inputs), so one graph can be called with either model's weights. Each model must get its
own program (its own K/V caches and generation), found again from the model for
`tp.reset(model)` and freed with the model. A model is told by its first weight in the
graph's inputs; entries go when that weight is freed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# id(weight) -> the programs running that model (weakly: the graph's cache owns them).
_PROGRAMS: dict[int, weakref.WeakSet] = {}


def owner_of(args: tuple, index: int | None) -> torch.Tensor | None:
    """The weight that identifies the model in this call's inputs (None: no weights)."""
    return args[index] if index is not None else None


def register(owner: torch.Tensor | None, program: Any) -> None:
    if owner is None:
        return
    key = id(owner)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = weakref.WeakSet()
        weakref.finalize(owner, _PROGRAMS.pop, key, None)
    _PROGRAMS[key].add(program)


def programs_of(module: torch.nn.Module) -> list[Any]:
    """The programs running `module` (or a module compiled in place with `.compile()`)."""
    found: list[Any] = []
    for tensor in (*module.parameters(), *module.buffers()):
        found += list(_PROGRAMS.get(id(tensor), ()))
    return found


class PerOwner:
    """A table per model, dropped when the model's identifying weight is freed, or with
    this object (the graph's, which Dynamo drops at a reset while the model lives on)."""

    def __init__(self) -> None:
        self.tables: dict[int | None, dict[Any, Any]] = {}

    def table(self, owner: torch.Tensor | None) -> dict[Any, Any]:
        key = None if owner is None else id(owner)
        if key not in self.tables:
            self.tables[key] = {}
            if owner is not None:  # holding this object weakly: the model outlives it
                weakref.finalize(owner, _drop_table, weakref.ref(self), key)
        return self.tables[key]


def _drop_table(per_owner: weakref.ref, key: int) -> None:
    found = per_owner()
    if found is not None:
        found.tables.pop(key, None)
