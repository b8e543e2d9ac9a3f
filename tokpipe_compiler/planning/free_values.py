"""The plain Python values a step function reads from its globals and closure: a trace
holds them as constants (Dynamo guards its own graphs on them; a ring, which runs its
trace for whole generations, keys its traces on them instead)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def free_values(fn: Callable[..., Any]) -> tuple:
    """The plain Python values (numbers, strings, and tuples, lists and dicts of them)
    `fn`'s code reads from its globals and closure: a trace holds them as constants, so
    another value (a guidance scale set between runs) needs a trace of its own."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    found = []
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False))
    for name, cell in cells.items():
        with contextlib.suppress(ValueError):  # a cell not yet filled
            found.append((name, cell.cell_contents))
    names = {n for c in _codes(code) for n in c.co_names}
    found += [(name, fn.__globals__[name]) for name in sorted(names)
              if name in getattr(fn, "__globals__", {})]
    return tuple((name, repr(value)) for name, value in found if _plain(value))


def _codes(code: Any) -> list[Any]:
    """`code` and the code of the functions (lambdas, comprehensions) defined in it."""
    nested = [c for c in code.co_consts if hasattr(c, "co_names")]
    return [code, *(inner for c in nested for inner in _codes(c))]


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, (bool, int, float, complex, str, type(None))):
        return True
    if depth or not isinstance(value, (tuple, list, dict)) or len(value) > 64:
        return False
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return all(_plain(k, 1) and _plain(v, 1) for k, v in items)
