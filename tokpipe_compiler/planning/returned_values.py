"""What a traced function returns, value by value, where its graph's outputs do not say.

Dynamo's graph outputs only the tensors the graph computes, once each: a tensor input
returned unchanged (`return x_next, history`) is rebuilt outside the graph, one computed
twice is output once, and constants or containers are Python values. A caller that maps a
function's return onto the graph's outputs (a ring's carry) reads them from here, taken
from the return value Dynamo holds as it compiles the graph. That value is a Dynamo
internal (its variable trackers, read by class name, as of torch 2.6-2.13): where it
cannot be read, `returned_values` says None and the caller falls back on the outputs.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

import torch


class Kind(enum.Enum):
    COMPUTED = "a tensor the graph computes: one of its outputs"
    INPUT = "a tensor input returned unchanged"
    CONTAINER = "a container holding tensors"
    OTHER = "anything else (a number, None, an object)"


@dataclass(frozen=True)
class Returned:
    """One value of a function's return (each entry, where it returns a tuple, a list or a
    dict)."""

    kind: Kind
    output: int | None = None  # COMPUTED: the graph output's position
    source: str = ""  # INPUT: where Dynamo found it ("L['latents']", "L['kw']['x']")
    type_name: str = ""  # CONTAINER and OTHER: its Python type
    key: str | None = None  # its key, where the function returns a dict

    @property
    def is_tensor(self) -> bool:
        return self.kind in (Kind.COMPUTED, Kind.INPUT)

    def describe(self) -> str:
        at = "" if self.key is None else f"{self.key!r}: "
        if self.kind == Kind.COMPUTED:
            return f"{at}a tensor it computes"
        if self.kind == Kind.INPUT:
            return f"{at}its input {readable(self.source)!r} unchanged"
        if self.kind == Kind.CONTAINER:
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
        if kind in _SEQUENCES:
            return tuple(_returned(item, outputs) for item in value.items)
        return (_returned(value, outputs),)  # one tensor, or an object taken whole
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None


_SEQUENCES = ("TupleVariable", "ListVariable", "NamedTupleVariable")
_CONTAINERS = (*_SEQUENCES, "ConstDictVariable")


def _returned(item: Any, outputs: list) -> Returned:
    proxy = getattr(item, "proxy", None)
    if type(item).__name__ == "TensorVariable" and proxy is not None:
        if proxy.node in outputs:
            return Returned(Kind.COMPUTED, output=outputs.index(proxy.node))
        source = getattr(item, "source", None)
        name = source.name() if callable(getattr(source, "name", None)) else \
            getattr(source, "name", "")
        return Returned(Kind.INPUT, source=str(name))
    kind = Kind.CONTAINER if _holds_tensors(item) else Kind.OTHER
    return Returned(kind, type_name=_python_type(item))


def _holds_tensors(item: Any, depth: int = 0) -> bool:
    if type(item).__name__ == "TensorVariable":
        return True
    if depth > 4 or type(item).__name__ not in _CONTAINERS:  # 4: nesting worth opening
        return False
    inner = item.items
    values = inner.values() if isinstance(inner, dict) else inner
    return any(_holds_tensors(v, depth + 1) for v in values)


def _python_type(item: Any) -> str:
    try:
        return item.python_type().__name__
    except Exception:  # a tracker that cannot say
        return type(item).__name__


def readable(source: str) -> str:
    """A Dynamo source as the user wrote it: `L['latents']` -> `latents`,
    `L['conds']['labels']` -> `conds['labels']`."""
    return re.sub(r"^L\['(\w+)'\]", r"\1", source)
