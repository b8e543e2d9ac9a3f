"""The per-call prelude as the runtime calls it: the work every chunk shares (timestep and
text conditioning, per-layer modulation, positional tables), run once per step.

Under the `inductor` stage compiler it is compiled too, lazily at its first call with that
call's inputs as examples. Left eager, it would launch one kernel per op: for a 28-block
DiT that is hundreds of launches a step (each block's text K/V projections and modulation
live here), where the serial model compiles them with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx

from tokpipe_compiler.core.fx import node_count
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.stage_programs.compile import compile_named, gist


class Prelude:
    """`gm` (returning the values named `outputs`) compiled by `compiler` on first call.

    Many of a prelude's outputs are its own inputs passed on (the weights the stages read):
    those are handed over as they are, and only the values it computes go through the
    compiled graph, which takes only the inputs it computes from. Passed through a compiled
    graph, each would cost a size and stride check and an output alias every call (608
    inputs and 708 outputs for a 28-block PixArt, 454 of them passed on).

    It also runs the writes into the inputs (`self.ema.mul_(0.9)`), once per call, when
    it computes nothing else. A prelude Inductor cannot compile runs eagerly from then on,
    with a warning.
    """

    def __init__(self, gm: torch.fx.GraphModule, outputs: list[str], compiler: str):
        self.compiler = compiler
        self.passed, self.reads, self.computed, self.gm = _without_pass_through(gm, outputs)
        self.runs = bool(node_count(self.gm))  # it computes, or writes into an input
        self._fn: Callable[..., Sequence] | None = self.gm if compiler == "eager" else None

    def __call__(self, *args) -> dict:
        """The prelude's values by name."""
        values = {name: args[i] for name, i in self.passed}
        if not self.runs:
            return values
        reads = [args[i] for i in self.reads]
        if self._fn is None:
            self._fn = self._compiled(reads)
        values.update(zip(self.computed, self._fn(*reads), strict=True))
        return values

    def _compiled(self, args: list) -> Callable[..., Sequence]:
        try:
            return compile_named("the per-call prelude", self.gm, args, self.compiler)
        except Exception as e:
            warn(f"tokpipe: the per-call prelude runs eagerly: inductor could not "
                 f"compile it ({gist(e)})")
            return self.gm


def _without_pass_through(gm: torch.fx.GraphModule, outputs: list[str]
                          ) -> tuple[list[tuple[str, int]], list[int], list[str],
                                     torch.fx.GraphModule]:
    """(outputs that are inputs, as (name, input index); the indices of the inputs the rest
    computes from; the names of the computed outputs; a graph of those inputs returning the
    computed outputs)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders)}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    passed = [(name, index[v]) for name, v in zip(outputs, values, strict=True) if v in index]
    computed = [(name, v) for name, v in zip(outputs, values, strict=True) if v not in index]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[v] if isinstance(v, torch.fx.Node) else v for _, v in computed))
    reads = []
    for node in placeholders:
        if env[node].users:
            reads.append(index[node])
        else:
            graph.erase_node(env[node])
    return passed, reads, [name for name, _ in computed], torch.fx.GraphModule(gm, graph,
                                                                              "prelude")
