"""What a traced function returns, value by value, where its graph's outputs do not say.

Dynamo's graph outputs only the tensors the graph computes, once each: a tensor input
returned unchanged (`return x_next, history`) is rebuilt outside the graph, one computed
twice is output once, and constants or containers are Python values. A caller that maps a
function's return onto the graph's outputs (a ring's carry) reads them from here, taken
from the return value Dynamo holds as it compiles the graph.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

COMPUTED, INPUT, CONTAINER, OTHER = "computed", "input", "container", "other"


@dataclass(frozen=True)
class Returned:
    """One value of a function's return (of each entry where it returns a tuple, a list or
    a dict)."""

    kind: str  # COMPUTED (a graph output), INPUT (an input unchanged), CONTAINER, OTHER
    output: int | None = None  # COMPUTED: the graph output's position
    source: str = ""  # INPUT: where it came from ("latents", "conds['labels']")
    type_name: str = ""  # CONTAINER and OTHER: its Python type
    key: str | None = None  # its key, where the function returns a dict

    def describe(self) -> str:
        at = "" if self.key is None else f"{self.key!r}: "
        if self.kind == COMPUTED:
            return f"{at}a tensor it computes"
        if self.kind == INPUT:
            return f"{at}its input {self.source!r} unchanged"
        if self.kind == CONTAINER:
            return f"{at}a {self.type_name} holding tensors"
        return f"{at}a {self.type_name}"


def returned_values(gm: torch.fx.GraphModule) -> tuple[Returned, ...] | None:
    """Each value the call Dynamo compiles now returns (called from a backend, at the
    frame's return); None where Dynamo does not say (a graph break, another version)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        stack = InstructionTranslator.current_tx().stack
        if len(stack) != 1:
            return None
        value, kind = stack[0], type(stack[0]).__name__
        outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        if kind == "ConstDictVariable":  # a plain dict: each entry by its key
            return tuple(dataclasses.replace(_returned(item, outputs),
                                             key=str(key.vt.as_python_constant()))
                         for key, item in value.items.items())
        if kind in ("TupleVariable", "ListVariable"):
            return tuple(_returned(item, outputs) for item in value.items)
        if kind == "TensorVariable":
            return (_returned(value, outputs),)
        return None  # another kind of object (a named tuple, a model's output class)
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None


def _returned(item: Any, outputs: list) -> Returned:
    proxy = getattr(item, "proxy", None)
    if type(item).__name__ == "TensorVariable" and proxy is not None:
        if proxy.node in outputs:
            return Returned(COMPUTED, output=outputs.index(proxy.node))
        source = getattr(item, "source", None)
        name = source.name() if callable(getattr(source, "name", None)) else \
            getattr(source, "name", "")
        return Returned(INPUT, source=_readable(str(name)))
    python_type = _python_type(item)
    if _holds_tensors(item):
        return Returned(CONTAINER, type_name=python_type)
    return Returned(OTHER, type_name=python_type)


_CONTAINERS = ("TupleVariable", "ListVariable", "ConstDictVariable", "NamedTupleVariable")


def _holds_tensors(item: Any, depth: int = 0) -> bool:
    if type(item).__name__ == "TensorVariable":
        return True
    if depth > 4 or type(item).__name__ not in _CONTAINERS:
        return False
    inner = item.items
    values = inner.values() if isinstance(inner, dict) else inner
    return any(_holds_tensors(v, depth + 1) for v in values)


def _python_type(item: Any) -> str:
    try:
        return item.python_type().__name__
    except Exception:  # a tracker that cannot say
        return type(item).__name__


def _readable(source: str) -> str:
    """`L['latents']` -> `latents`; `L['kwargs']['conds']['w']` -> `conds['w']`."""
    source = re.sub(r"^L\['kwargs'\]\['([^']+)'\]", r"\1", source)
    return re.sub(r"^L\['(\w+)'\]", r"\1", source)
