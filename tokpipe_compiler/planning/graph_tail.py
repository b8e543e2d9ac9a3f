"""A check at the end of a model's forward, run on the whole output after the pipeline.

    o = blocks(x)                        # pipelined, chunk by chunk
    if torch.isnan(o).any(): raise ...   # the tail: mixes every token of o, feeds no block

An op that mixes tokens cannot run on one chunk. Where every such op only leads to the
graph's outputs, through element-wise ops and reductions (no matrix product: no layer, no
attention the compiler could not chunk, which would leave the blocks after it unpipelined),
the graph splits in two: the body, pipelined, returns the values the tail reads, gathered
whole as every output is; the tail then runs on them, unpipelined, on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.errors import TokpipeError, UnchunkableOps
from tokpipe_compiler.core.fx import target_name
from tokpipe_compiler.core.logs import LOG
from tokpipe_compiler.passes.split import written_base
from tokpipe_compiler.passes.token_input import ATTENTION_OPS


@dataclass(frozen=True)
class GraphTail:
    """`body` returns the values `tail` reads; `tail(*those, *inputs)` returns the outputs
    of the graph, with `inputs` the graph's arguments at `input_positions`."""

    body: torch.fx.GraphModule
    tail: torch.fx.GraphModule
    input_positions: tuple[int, ...]
    ops: tuple[str, ...]  # the tail's ops that mix tokens

    def run(self, body_program: Callable, *args: Any) -> Any:
        values = body_program(*args)
        return self.tail(*values, *(args[i] for i in self.input_positions))


def split_tail(gm: torch.fx.GraphModule, mixing: Iterable[str]) -> GraphTail | None:
    """The split of `gm` at the ops named `mixing` (those that mix tokens), or None where
    they are not a tail: a matrix product follows them (or is one of them), or one of them
    is not a node of `gm` (a pass wrote it)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    mixing = list(mixing)
    if not mixing or any(name not in nodes for name in mixing):
        return None
    tail = _computed_from([nodes[name] for name in mixing])
    if any(n.target in ATTENTION_OPS or _multiplies_matrices(n) for n in tail):
        return None
    if _writes_from(tail[0]):  # a write's readers are no users of it: no split can see them
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = _read_by(tail)
    computed = [n for n in read if n.op != "placeholder"]
    if not computed:  # the ops read only inputs: nothing of the body is left to pipeline
        return None
    inputs = [n for n in placeholders if n in read]
    return GraphTail(_body(gm, tail, computed), _tail(gm, tail, computed, inputs),
                     tuple(placeholders.index(n) for n in inputs), tuple(mixing))


def _computed_from(start: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """`start` and every node computed from it, in graph order, the output left out."""
    found = set(start)
    stack = list(start)
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and user not in found:
                found.add(user)
                stack.append(user)
    return [n for n in start[0].graph.nodes if n in found]


def _writes_from(first: torch.fx.Node) -> bool:
    """Whether `first` or a node after it writes a tensor in place."""
    node = first
    while node.op != "output":
        if written_base(node) is not None:
            return True
        node = node.next
    return False


def _multiplies_matrices(node: torch.fx.Node) -> bool:
    name = target_name(node)
    return name in _MATRIX_PRODUCTS or name.startswith("conv")


_MATRIX_PRODUCTS = {"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "einsum",
                    "tensordot", "__matmul__"}


def _read_by(tail: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes outside `tail` that the tail or the graph's output reads, in graph order
    (the output's own values pass through the tail, so the tail returns every output)."""
    inside = set(tail)
    output = next(iter(tail[0].graph.find_nodes(op="output")))
    read = {i for n in [*tail, output] for i in n.all_input_nodes if i not in inside}
    return [n for n in tail[0].graph.nodes if n in read]


def _body(gm: torch.fx.GraphModule, tail: list[torch.fx.Node],
          returned: list[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inside = set(tail)
    for node in gm.graph.nodes:
        if node.op != "output" and node not in inside:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in returned))
    return torch.fx.GraphModule(gm, graph)


def _tail(gm: torch.fx.GraphModule, tail: list[torch.fx.Node], computed: list[torch.fx.Node],
          inputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in [*computed, *inputs]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in tail:
        env[node] = graph.node_copy(node, env.__getitem__)
    output = next(iter(gm.graph.find_nodes(op="output")))
    graph.output(torch.fx.map_arg(output.args[0], env.__getitem__))
    return torch.fx.GraphModule(gm, graph)


def plan_with_tail(gm: torch.fx.GraphModule,
                   plan: Callable[[torch.fx.GraphModule], Any]) -> tuple[Any, GraphTail | None]:
    """`plan(gm)`, or where ops that mix tokens end the graph, the plan of its body and the
    tail that runs after it. The planning error stands where they are not a tail, or where
    the body holds nothing to pipeline (no attention, no sum over tokens: no caches), as
    when mixing the tokens is all the model does."""
    try:
        return plan(gm), None
    except UnchunkableOps as err:
        split = split_tail(gm, err.nodes)
        if split is None:
            raise
        try:
            body = plan(split.body)
        except TokpipeError:
            raise err from None
        if not body.caches:
            raise
    LOG.info("the ops %s mix tokens at the end of the graph: they and what follows them run "
             "after the pipeline, on its whole outputs", ", ".join(split.ops))
    return dataclasses.replace(body, tail_ops=split.ops), split
