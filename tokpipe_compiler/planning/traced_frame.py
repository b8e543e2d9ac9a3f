"""What the backend reads from the frame Dynamo is tracing while it calls the backend: the
forward's parameter names, the names of arguments passed by position through a decorated
forward's *args, and the arguments the call passed as Python numbers.

Both are read from Dynamo's current instruction translator (its frame's code and locals at
entry); where that internal is missing, nothing is known and the callers say so.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import source_name
from tokpipe_compiler.core.meta import POSITION_KEY

RESUME = "torch_dynamo_resume_in_"  # Dynamo's name for a frame resumed after a break


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
    elif code.co_name.startswith(RESUME) and isinstance(local.get("self"), torch.nn.Module):
        # a resume function after a graph break inside a module's method: its parameters
        # are the live locals, among them `self`; the forward's are the model's
        names |= signature_names(local["self"].forward)
    return frozenset(names)


def name_positions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Name the graph's inputs passed by position through a decorated forward's `*args`
    (`wrapper(self, *args, **kwargs)`, or transformers' `wrapped(*args, **kwargs)` whose
    args[0] is the module) by the forward's own parameters: `L['args'][1]` is `input_ids`
    (recorded as `POSITION_KEY`, read by `core.fx.argument_of`)."""
    found = _positional_parameters()
    if found is None:
        return gm
    varargs, names = found
    for node in gm.graph.nodes:
        match = re.fullmatch(rf"L\['{varargs}'\]\[(\d+)\]", source_name(node))
        if node.op == "placeholder" and match and int(match[1]) in names:
            node.meta[POSITION_KEY] = names[int(match[1])]
    return gm


def _positional_parameters() -> tuple[str, dict[int, tuple[str, int]]] | None:
    """The traced frame's *args name, and for each place in it the forward parameter it
    stands for and that argument's place in the user's call; None where the frame takes
    no *args or is no module's (decorated) forward."""
    frame = _frame()
    if frame is None or not frame[0].co_flags & inspect.CO_VARARGS:
        return None
    code, local = frame
    varargs = code.co_varnames[code.co_argcount + code.co_kwonlyargcount]
    args, module = local.get(varargs), _module_self(code, local)
    skip = code.co_argcount - 1  # the frame's own positional parameters after self
    if module is None and not code.co_argcount and isinstance(args, tuple) and args and \
            isinstance(args[0], torch.nn.Module):
        module, skip = args[0], -1  # self is args[0]
    if module is None or not isinstance(args, tuple) or not _wraps_forward(module, code):
        return None
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in itertools.takewhile(
        lambda p: p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), parameters)]
    return varargs, {i: (positional[skip + i], skip + i) for i in range(len(args))
                     if 0 <= skip + i < len(positional)}


def _wraps_forward(module: torch.nn.Module, code: Any) -> bool:
    """Whether `code` is the module's forward, or a decorator's wrapper of it (followed by
    `__wrapped__`): only there do the frame's *args stand for the forward's parameters."""
    fn = getattr(module.forward, "__func__", module.forward)
    while fn is not None:
        if getattr(fn, "__code__", None) is code:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


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
