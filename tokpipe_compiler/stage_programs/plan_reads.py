"""What a program reads off its plan: which graph inputs are the forward's arguments and
which its weights, what stays in place between calls, and a ring's carry edges."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tokpipe_compiler.core.fx import argument_of, input_label, weight_path
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
    """Stage inputs that stay in place from call to call: the weights (graph inputs the
    call does not pass) and the caches."""
    weights = {n.name for n in _placeholders(plan) if input_label(n) is None}
    return frozenset(weights | {name for spec in plan.caches for name in spec.names})


def input_arguments(plan: Plan) -> list[str | int | None]:
    """The forward's argument each graph input holds, in call order (None for weights, and
    for entries of arguments nested deeper than one subscript: see `input_labels`)."""
    return [argument_of(n) for n in _placeholders(plan)]


def input_labels(plan: Plan) -> list[str | None]:
    """A distinct name for each graph input the call passes, however deep in its
    arguments (a ControlNet's residuals in a list), in call order; None for weights. An
    entry of a dict goes by its key where no other input does (a ring step's
    `**tensors`), else by its path (`cond['scale']`, `uncond['scale']`)."""
    nodes = _placeholders(plan)
    full = [input_label(n) for n in nodes]
    short = [_key_name(n, label) for n, label in zip(nodes, full, strict=True)]
    counts = Counter(short)
    return [name if name is not None and counts[name] == 1 else label
            for name, label in zip(short, full, strict=True)]


def _key_name(node: Any, label: str | None) -> str | None:
    """The argument's name or dict key alone (`argument_of`), where it is one."""
    argument = argument_of(node)
    return argument if label is not None and isinstance(argument, str) else label


def weight_inputs(plan: Plan) -> list[tuple[int, str]]:
    """Each weight's position among the graph inputs and its path in the model."""
    return [(i, weight_path(n)) for i, n in enumerate(_placeholders(plan))
            if input_label(n) is None]


def _placeholders(plan: Plan) -> list:
    return [n for n in plan.graphs.prelude.graph.nodes if n.op == "placeholder"]
