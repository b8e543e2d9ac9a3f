"""What the backend reads from the frame Dynamo is tracing while it calls the backend: the
forward's parameter names, and the arguments the call passed as Python numbers.

Both are read from Dynamo's current instruction translator (its frame's code and locals at
entry); where that internal is missing, nothing is known and the callers say so.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch


def frame_parameters() -> frozenset[str] | None:
    """The parameter names of the function whose frame Dynamo traces, and of
    `self.forward` when the frame has a module `self` (a decorated forward, a resume
    function after a graph break); "**" among them when a signature takes **kwargs, "*"
    when the traced function takes *args. None
    when unknown."""
    frame = _frame()
    if frame is None:
        return None
    code, local = frame
    names = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    if code.co_flags & inspect.CO_VARKEYWORDS:
        names.add("**")
    if code.co_flags & inspect.CO_VARARGS:
        names.add("*")  # inputs by position: a timestep_input may be one
    module = _module_self(code, local)
    if module is not None:
        names.discard(code.co_varnames[0])  # `self`, by whatever name
        # diffusers decorates forward as wrapper(self, *args, **kwargs): its signature
        # (functools.wraps) names the real parameters.
        names -= {"*", "**"}
        names |= signature_names(module.forward)
    return frozenset(names)


def number_arguments() -> dict[str, int | float]:
    """The call's arguments that are Python numbers (not bools), by parameter name: Dynamo
    specialises a graph on their values, so each new value is a new graph. Read through a
    decorated forward's (*args, **kwargs) too, by `self.forward`'s signature."""
    frame = _frame()
    if frame is None:
        return {}
    code, local = frame
    parameters = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    found = {name: local[name] for name in parameters if name in local}
    args, kwargs = local.get("args"), local.get("kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    found.update(kwargs)
    module = _module_self(code, local)
    if module is not None and isinstance(args, tuple):
        # not the forward's own arguments (a resume function's): keep what is known
        with contextlib.suppress(TypeError, ValueError):
            found.update(inspect.signature(module.forward).bind_partial(*args, **kwargs)
                         .arguments)
    return {name: value for name, value in found.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def traced_function() -> tuple[Any, int | None] | None:
    """The code object of the frame Dynamo traces and the id of its `self` (a hook or
    module method shared by several modules is traced once per module), or None outside
    a Dynamo trace."""
    frame = _frame()
    if frame is None:
        return None
    code, local = frame
    owner = local.get("self")
    return code, None if owner is None else id(owner)


def _module_self(code: Any, local: dict[str, Any]) -> torch.nn.Module | None:
    """The module a traced method runs on: its first parameter's value, whatever the
    parameter's name, where that is a module."""
    first = code.co_varnames[0] if code.co_argcount else None
    module = local.get(first) if first is not None else None
    return module if isinstance(module, torch.nn.Module) else None


def _frame() -> tuple[Any, dict[str, Any]] | None:
    """The traced frame's code and locals, or None outside a Dynamo trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return tx.f_code, tx.f_locals
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None


def signature_names(fn: Callable[..., Any]) -> set[str]:
    """`fn`'s parameter names, "**" and "*" for its **kwargs and *args (all: unknown)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {"**"}
    return {_MARKS.get(p.kind, p.name) for p in parameters}


_MARKS = {inspect.Parameter.VAR_KEYWORD: "**", inspect.Parameter.VAR_POSITIONAL: "*"}
