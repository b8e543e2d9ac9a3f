"""Writes into a graph's inputs at its start, run on the whole inputs before the pipeline.

    prior[drop] *= 0.0                   # the head: writes an input, reads only inputs
    h = x + proj(prior)                  # pipelined, chunk by chunk, reading the new prior

A write of token values into an input cannot be chunked: each chunk would write its own
part, on its own stage's rank only. Where such a write reads nothing but the graph's inputs
and no other op reads what it writes before it (as at the start of a graph Dynamo resumed
after a break inside `x[mask] *= 0.0`), it runs first, unpipelined, on every rank, on the
whole input, exactly as eager runs it; the rest of the graph, the body, reads the written
input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.errors import UnchunkableOps
from tokpipe_compiler.core.fx import target_name
from tokpipe_compiler.core.logs import LOG
from tokpipe_compiler.passes.split import alias_of, writes_into, written_base

Node = torch.fx.Node


@dataclass(frozen=True)
class GraphHead:
    """`head(*inputs)` writes the inputs; `body(*inputs)` is the rest of the graph."""

    head: torch.fx.GraphModule
    body: torch.fx.GraphModule
    ops: tuple[str, ...]  # the head's writes, for the log

    def run(self, body_program: Callable, *args: Any) -> Any:
        self.head(*args)
        return body_program(*args)


def split_head(gm: torch.fx.GraphModule) -> GraphHead | None:
    """The writes into inputs that can run before the rest of `gm`, split off; None where
    there are none."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    head: set[Node] = set()
    for node in gm.graph.nodes:
        base = written_base(node)
        if base is None or base.op != "placeholder":
            continue
        cone = _computed_ancestors(node) - head
        if _hoistable(node, base, cone, head, order):
            head |= cone
    if not head:
        return None
    nodes = [n for n in gm.graph.nodes if n in head]
    return GraphHead(_head(gm, nodes), _body(gm, head),
                     tuple(f"{target_name(n)} ({n.name})" for n in nodes if writes_into(n)))


def _computed_ancestors(node: Node) -> set[Node]:
    """`node` and the values it is computed from, the graph's inputs left out."""
    found, stack = {node}, [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent.op not in ("placeholder", "get_attr") and parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _hoistable(write: Node, base: Node, cone: set[Node], head: set[Node],
               order: dict[Node, int]) -> bool:
    """Whether `write` with what it is computed from (`cone`) can run before the graph:
    nothing of the cone is read outside it and the head (but the write itself, through its
    input), and nothing else reads the input, or a view of it, before the write."""
    inside = cone | head
    for node in cone:
        if node is write and writes_into(write) is base:
            continue  # its readers read the input, as they will in the body
        if any(user not in inside for user in node.users):
            return False
    views = {base}
    for node in base.graph.nodes:
        if alias_of(node) in views and node not in inside:
            views.add(node)
    return not any(order[user] < order[write] and user not in inside
                   for view in views for user in view.users)


def _head(gm: torch.fx.GraphModule, nodes: list[Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(None)
    return torch.fx.GraphModule(gm, graph)


def _body(gm: torch.fx.GraphModule, head: set[Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node in head:  # a write's readers read the input it wrote
            target = writes_into(node)
            if target is not None and target in env:
                env[node] = env[target]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(gm, graph)


def plan_with_head(gm: torch.fx.GraphModule, plan: Callable[[torch.fx.GraphModule], Any]
                   ) -> tuple[Any, GraphHead | None]:
    """`plan(gm)`, or where writes into its inputs that cannot be chunked start the graph,
    the plan of the rest and the head that runs before it. The planning error stands
    where there is no such head, or where the rest cannot be planned either."""
    try:
        return plan(gm), None
    except UnchunkableOps as err:
        split = split_head(gm)
        if split is None:
            raise
        try:
            planned = plan(split.body)
        except UnchunkableOps:
            raise err from None
    LOG.info("the writes %s into the graph's inputs start it: they run before the "
             "pipeline, on the whole inputs", ", ".join(split.ops))
    return planned, split
