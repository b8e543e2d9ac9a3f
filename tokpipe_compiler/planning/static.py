"""Graphs with dynamic shapes, made static per concrete input shape.

Without `dynamic=False`, Dynamo retraces a model whose input shape changed with symbolic
sizes. The pipeline needs literal sizes (it specialises every stage per chunk length), so
such a graph is traced again, statically, for each concrete shape it is called with.
`dynamic=True` also passes the model's Python floats (a norm's eps, a dropout's p) as 0-dim
float64 tensors read with `.item()`; they are folded back into constants, and their values
join the shapes in the key that picks a static graph.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.node import map_arg

from tokpipe_compiler.core.fx import argument_of, example_value
from tokpipe_compiler.core.meta import POSITION_KEY, SOURCE_KEY
from tokpipe_compiler.planning.capture import capture

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def has_symbolic_shapes(gm: torch.fx.GraphModule) -> bool:
    """Whether any value is symbolic: a size, or a scalar input (`dynamic=True` makes a
    Python float a SymFloat input)."""
    for node in gm.graph.nodes:
        value = example_value(node)
        if isinstance(value, SYMBOLIC):
            return True
        if isinstance(value, torch.Tensor) and any(
                isinstance(size, torch.SymInt) for size in value.shape):
            return True
    return False


def wrapped_floats(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of the inputs that are Python floats passed as 0-dim float64 tensors: every
    use of the input reads its `.item()`."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, node in enumerate(inputs) if _is_wrapped_float(node))


def _is_wrapped_float(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return (isinstance(value, torch.Tensor) and value.dim() == 0
            and value.dtype == torch.float64 and len(node.users) > 0
            and all(u.op == "call_method" and u.target == "item" for u in node.users))


def shape_key(args: tuple, floats: tuple[int, ...] = ()) -> tuple:
    """What picks a static graph: the inputs' shapes and dtypes, the wrapped floats' values."""
    shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                   for a in args)
    return shapes, tuple(float(args[i]) for i in floats)


class StaticGraph:
    """`gm` traced again with concrete `args`; `select(args)` picks the new graph's inputs
    (size arguments become constants and drop out, and so do the wrapped floats at
    positions `floats`)."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple, floats: tuple[int, ...] = ()):
        plain = torch.fx.GraphModule(gm, _folded(gm.graph, args, floats))
        plain.recompile()  # Dynamo will not trace a lazy module
        self.gm = capture(plain, args, fullgraph=True)[-1].gm
        old = [n for n in gm.graph.nodes if n.op == "placeholder"]
        position = {n.target: i for i, n in enumerate(old)}
        self.order = []
        for node in self.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            # The new graph's inputs are the old graph's placeholders, by name.
            target = position[argument_of(node)]
            self.order.append(target)
            for key in (SOURCE_KEY, POSITION_KEY):
                if key in old[target].meta:
                    node.meta[key] = old[target].meta[key]

    def select(self, args: tuple) -> tuple:
        return tuple(args[i] for i in self.order)


def _folded(graph: torch.fx.Graph, args: tuple, floats: tuple[int, ...]) -> torch.fx.Graph:
    """A copy of `graph` whose wrapped floats' `.item()` reads are their values in `args`."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    inputs = [n for n in copy.nodes if n.op == "placeholder"]
    for i in floats:
        for item in list(inputs[i].users):
            _replace_uses(item, float(args[i]))
            copy.erase_node(item)
    return copy


def _replace_uses(node: torch.fx.Node, value: float) -> None:
    def swap(arg: torch.fx.Node) -> torch.fx.node.Argument:
        return value if arg is node else arg

    for user in list(node.users):
        user.args = map_arg(user.args, swap)
        user.kwargs = map_arg(user.kwargs, swap)
