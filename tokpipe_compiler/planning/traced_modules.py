"""The modules a traced step function read its weights from, found again at a later call.

A ring traces its step function once and keeps the graph with the weight tensors it read
then. Dynamo names where each came from (`G['model']._modules['0']._parameters['weight']`,
`L['self']._modules['proj']...`); the part before the first `_modules`, `_parameters` or
`_buffers` is the module the step reached (a global, a closure variable, `self`, a
partial's keyword). Evaluated again before a generation, it tells whether the step would
now read another module (`pipe.transformer = other`), or the same one changed other than
in place (a parameter assigned anew, a processor swapped: `module_state`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokpipe_compiler.core.fx import source_name
from tokpipe_compiler.planning.module_state import ModuleState, changed_parts, module_state

# Where a weight's source leaves the object the step reached for the module's own tables.
_INTO_MODULE = re.compile(
    r"\.(?:_(?:modules|parameters|buffers)\[|__dict__\['_(?:modules|parameters|buffers)'\])")


@dataclass(eq=False)
class _Root:
    expression: Any  # the compiled source expression
    text: str
    found: Any  # the object it named at the trace
    state: ModuleState | None  # of a module, at the trace


class TracedModules:
    """The modules (or tensors) a trace's weights came from, as they were at the trace."""

    def __init__(self, step_fn: Callable[..., Any], gm: torch.fx.GraphModule,
                 values: dict[str, Any]):
        self.step_fn = step_fn
        self.roots: list[_Root] = []
        for text in _root_sources(gm):
            expression = compile(text, "<traced source>", "eval")
            found = _evaluate(expression, step_fn, values)
            if found is not _MISSING:
                self.roots.append(_Root(expression, text, found, _state(found)))

    def changed(self, values: dict[str, Any]) -> str | None:
        """What differs now from the trace, for a message; None when nothing does."""
        for root in self.roots:
            now = _evaluate(root.expression, self.step_fn, values)
            if now is _MISSING:
                continue
            if now is not root.found:
                return f"{_readable(root.text)} is another object"
            state = _state(now)
            if state is not None and root.state is not None and state != root.state:
                return f"{_readable(root.text)} changed in {changed_parts(root.state, state)}"
        return None


def _root_sources(gm: torch.fx.GraphModule) -> list[str]:
    """The distinct objects the graph's weight placeholders were reached through."""
    roots = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        found = _INTO_MODULE.search(source_name(node))
        if found is not None and found.start() > 0:
            roots.append(source_name(node)[: found.start()])
    return list(dict.fromkeys(roots))


_MISSING = object()


def _evaluate(expression: Any, step_fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """The object a source names, in the step function's frame; _MISSING where it cannot
    be evaluated (a source form this does not rebuild)."""
    try:
        return eval(expression, {"__builtins__": {}},
                    {"G": _globals(step_fn), "L": _frame_locals(step_fn, values)})
    except Exception:
        return _MISSING


def _globals(fn: Callable[..., Any]) -> dict[str, Any]:
    target = _function(fn)
    return getattr(target, "__globals__", {})


def _frame_locals(fn: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """What Dynamo's `L[...]` names for a call of `fn` with keyword arguments `values`: the
    arguments, closure variables, a bound method's self, a partial and its keywords."""
    local: dict[str, Any] = {**values, "kwargs": values, "fn": fn}
    target = _function(fn)
    code = getattr(target, "__code__", None)
    if code is not None and target.__closure__:
        for name, cell in zip(code.co_freevars, target.__closure__, strict=True):
            with contextlib.suppress(ValueError):  # an empty cell has no contents
                local[name] = cell.cell_contents
    bound = getattr(fn, "__self__", None)
    if bound is not None and code is not None and code.co_varnames:
        local[code.co_varnames[0]] = bound
    return local


def _function(fn: Callable[..., Any]) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.unwrap(getattr(fn, "__func__", fn))


def _state(found: Any) -> ModuleState | None:
    return module_state(found) if isinstance(found, torch.nn.Module) else None


def _readable(text: str) -> str:
    """`G['h'].model` -> `h.model`; `L['self']` -> `self`."""
    return re.sub(r"[GL]\['(\w+)'\]", r"\1", text)
