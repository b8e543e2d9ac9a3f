"""What a program reads off its plan: which graph inputs are the forward's arguments and
which its weights, what stays in place between calls, and a ring's carry edges."""

from __future__ import annotations

from tokpipe_compiler.core.fx import argument_of, weight_path
from tokpipe_compiler.core.stage_graph import OutputKind
from tokpipe_compiler.planning.plan import Plan


def carry_edges(plan: Plan, carried: dict[str, str]) -> dict[int, set[int]]:
    """Ring edges: the stage computing a carried output -> the stages reading its input."""
    producer = {spec.source: spec.producer for spec in plan.graphs.outputs
                if spec.kind == OutputKind.TOKEN}
    edges: dict[int, set[int]] = {}
    for name, output in carried.items():
        readers = {g.index for g in plan.graphs.stages for i in g.inputs if i.source == name}
        edges.setdefault(producer[output], set()).update(readers)
    return edges


def persistent_inputs(plan: Plan) -> frozenset[str]:
    """Stage inputs that stay in place from call to call: the weights (graph inputs that
    are no forward argument) and the caches."""
    weights = {n.name for n in plan.graphs.prelude.graph.nodes
               if n.op == "placeholder" and argument_of(n) is None}
    return frozenset(weights | {name for spec in plan.caches for name in spec.names})


def input_arguments(plan: Plan) -> list[str | int | None]:
    """The forward's argument each graph input holds, in call order (None for weights)."""
    return [argument_of(n) for n in plan.graphs.prelude.graph.nodes if n.op == "placeholder"]


def weight_inputs(plan: Plan) -> list[tuple[int, str]]:
    """Each weight's position among the graph inputs and its path in the model."""
    placeholders = [n for n in plan.graphs.prelude.graph.nodes if n.op == "placeholder"]
    return [(i, weight_path(n)) for i, n in enumerate(placeholders) if argument_of(n) is None]
