"""Graphs with dynamic shapes, made static per concrete input shape.

Without `dynamic=False`, Dynamo retraces a model whose input shape changed with symbolic
sizes. The pipeline needs literal sizes (it specialises every stage per chunk length), so
such a graph is traced again, statically, for each concrete shape it is called with.
"""

from __future__ import annotations

import torch
import torch.fx

from tokpipe_compiler.core.fx import argument_of, example_value
from tokpipe_compiler.core.meta import SOURCE_KEY
from tokpipe_compiler.planning.capture import capture


def has_symbolic_shapes(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(
                isinstance(size, torch.SymInt) for size in value.shape):
            return True
    return False


def shape_key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class StaticGraph:
    """`gm` traced again with concrete `args`; `select(args)` picks the new graph's inputs
    (size arguments become constants and drop out)."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple):
        plain = torch.fx.GraphModule(gm, gm.graph)  # Dynamo will not trace a lazy module
        plain.recompile()
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
            if SOURCE_KEY in old[target].meta:
                node.meta[SOURCE_KEY] = old[target].meta[SOURCE_KEY]

    def select(self, args: tuple) -> tuple:
        return tuple(args[i] for i in self.order)
