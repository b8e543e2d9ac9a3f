"""How much of a model that Dynamo split at graph breaks is pipelined.

Each graph of such a model is a pipeline of its own, or runs as traced where it holds no
attention over its tokens (each says so in a warning of its own). What those warnings do
not tell is the whole: how many graphs there are and what share of the model's work the
pipelined ones hold. `GraphTally` records each graph's outcome as it is planned, and
`summary` makes the one line that `parallelize` gives after a call that planned them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from tokpipe_compiler.costmodel.cost import graph_cost


@dataclass(frozen=True)
class GraphOutcome:
    """One graph Dynamo made of a model: whether it is pipelined, and its FLOPs (None where
    the cost model could not count them)."""

    pipelined: bool
    flops: float | None


class GraphTally:
    """The outcomes of the graphs a backend planned, in order; `take_new` hands over those
    recorded since it was last called."""

    def __init__(self) -> None:
        self.outcomes: list[GraphOutcome] = []
        self._taken = 0
        self._first: object = None  # what recorded the first outcome not yet taken

    def record(self, gm: torch.fx.GraphModule, pipelined: bool, by: object = None) -> None:
        if len(self.outcomes) == self._taken:
            self._first = by
        self.outcomes.append(GraphOutcome(pipelined, graph_flops(gm)))

    def take_new(self) -> list[GraphOutcome]:
        new, self._taken = self.outcomes[self._taken:], len(self.outcomes)
        return new

    def call_done(self, caller: object) -> bool:
        """Whether `caller`, the graph that recorded the first new outcome, is called again:
        the model's call that planned the new graphs is over (its first graph runs first)."""
        return len(self.outcomes) > self._taken and caller is self._first


def graph_flops(gm: torch.fx.GraphModule) -> float | None:
    """FLOPs of one call of `gm` as Dynamo traced it (its concrete shapes)."""
    try:
        return float(graph_cost(gm.graph.nodes, 1).flops)
    except Exception:  # a rule that cannot count a traced op: no share, not a failed call
        return None


def summary(model: str, outcomes: list[GraphOutcome]) -> str | None:
    """The line for `model`'s graphs planned in one call; None for a model traced whole."""
    if len(outcomes) < 2:
        return None
    pipelined = [o for o in outcomes if o.pipelined]
    counted = [o.flops for o in outcomes if o.flops is not None]
    share = ""
    if len(counted) == len(outcomes) and sum(counted) > 0:
        percent = 100 * sum(o.flops for o in pipelined) / sum(counted)
        share = f", holding {percent:.0f}% of its FLOPs"
    traced = len(outcomes) - len(pipelined)
    if not pipelined:
        return (f"tokpipe: {model} ran as {len(outcomes)} graphs (Dynamo split it at graph "
                "breaks) and none holds attention over its tokens: it ran unpipelined. "
                "torch._dynamo.explain(model)(...) lists the breaks; a model traced whole "
                "(fullgraph=True) is pipelined whole")
    return (f"tokpipe: {model} ran as {len(outcomes)} graphs (Dynamo split it at graph "
            f"breaks): {len(pipelined)} pipelined{share}, {traced} run as traced. Each "
            "pipelined graph fills and drains a pipeline of its own at every call, so a "
            "model traced whole gains more; torch._dynamo.explain(model)(...) lists the "
            "breaks")
