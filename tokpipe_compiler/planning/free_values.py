"""The plain Python values a step function reads outside its arguments: a trace holds them
as constants (Dynamo guards its own graphs on them; a ring, which runs its trace for
whole generations, keys its traces on them instead).

Read off the function's bytecode: the globals and closure variables it loads, the
attributes it reads of those (`cfg.scale`) and of its bound `self`, and the same in the
functions of the user's own code it calls by name (`helper()`), a few calls deep. A value
is plain where it is a number, a string, None, or a short tuple, list or dict of them.
Values reached otherwise (through a module's attribute: modules are followed by
`traced_modules`; through an argument's attribute; through functions of libraries) are
not read here.
"""

from __future__ import annotations

import contextlib
import dis
import types
from collections.abc import Callable
from typing import Any

import torch

_LIBRARIES = ("torch", "tokpipe_compiler", "diffusers", "transformers", "numpy")
_DEPTH = 3  # calls followed into the user's own functions


def free_values(fn: Callable[..., Any]) -> tuple:
    """((where, repr(value)), ...) of the plain values `fn` reads outside its arguments."""
    found: dict[str, str] = {}
    _read(fn, found, set(), 0)
    return tuple(sorted(found.items()))


def _read(fn: Any, found: dict[str, str], seen: set[int], depth: int) -> None:
    bound = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen or depth > _DEPTH:
        return
    seen.add(id(code))
    cells = {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # a cell not yet filled
            cells[name] = cell.cell_contents
    own = {"self": bound} if bound is not None and code.co_varnames[:1] == ("self",) else {}
    for inner in _codes(code):
        _read_loads(inner, fn.__globals__, cells, own, found, seen, depth)


def _read_loads(code: Any, globals_: dict, cells: dict, own: dict, found: dict[str, str],
                seen: set[int], depth: int) -> None:
    """Each load of a global, closure or bound-self value, and the attributes read off it
    (a module's and a tensor's are followed otherwise)."""
    scopes = {"LOAD_GLOBAL": globals_, "LOAD_DEREF": cells, "LOAD_FAST": own}
    where, value = None, None
    for ins in dis.get_instructions(code):
        scope = scopes.get(ins.opname, {})
        if isinstance(ins.argval, str) and ins.argval in scope:
            where, value = ins.argval, scope[ins.argval]
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and where is not None and \
                not isinstance(value, (torch.nn.Module, torch.Tensor)):
            where, value = f"{where}.{ins.argval}", getattr(value, ins.argval, None)
        else:
            where = None
            continue
        _note(where, value, found, seen, depth)


def _note(where: str, value: Any, found: dict[str, str], seen: set[int], depth: int) -> None:
    """A loaded value: plain, noted; a function of the user's own code, read in turn."""
    if _plain(value):
        found[where] = repr(value)
    elif isinstance(value, (types.FunctionType, types.MethodType)) and not \
            (getattr(value, "__module__", "") or "").startswith(_LIBRARIES):
        _read(value, found, seen, depth + 1)


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
