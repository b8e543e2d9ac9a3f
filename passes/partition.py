"""partition: stage cut points on the residual stream, balanced by cost.

Token-carrying nodes, in graph order, are cut into `stages` contiguous runs. A cut may only
fall where the fewest token values are live (the residual stream between blocks); among
those, a dynamic program picks the cuts that minimise the slowest stage. Invariant nodes
belong to no stage: they run once per call in a prelude and are replicated where used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch.fx

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.passes.split import is_chunk_source


@dataclass(frozen=True)
class Partition:
    stage_of: dict[torch.fx.Node, int]  # every token-carrying node -> its stage
    cuts: tuple[int, ...]  # index into `order` of the first node of stages 1..S-1
    order: tuple[torch.fx.Node, ...]  # token-carrying nodes in graph order
    weights: tuple[float, ...]  # per-node weight used to balance (seconds or FLOPs)


def token_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes a stage computes: token-carrying, and not cut from a per-call tensor."""
    return [n for n in gm.graph.nodes if n.op != "output" and n.meta[META_KEY].carries_tokens
            and not is_chunk_source(n)]


def partition(gm: torch.fx.GraphModule, stages: int, weight: Callable[[torch.fx.Node], float],
              chunk_fraction: float, flops_per_byte: float = 0.0) -> Partition:
    """weight: a node's cost on one chunk (FLOPs, from the cost model); chunk_fraction: a
    typical chunk's share of the sequence. flops_per_byte: what sending one byte between
    stages costs, in FLOPs of compute time (device rate / link bandwidth; 0 when the
    stages share a process)."""
    order = token_nodes(gm)
    weights = [weight(n) for n in order]
    live = live_counts(order)
    sends = [flops_per_byte * b for b in live_bytes(order, chunk_fraction)]
    cuts = _choose_cuts(weights, live, stages, sends)
    stage_of, stage = {}, 0
    for i, node in enumerate(order):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        stage_of[node] = stage
    return Partition(stage_of, tuple(cuts), tuple(order), tuple(weights))


def live_counts(order: list[torch.fx.Node]) -> list[int]:
    """live[i]: token values defined before position i and used at or after it, i.e. what a
    cut in front of node i would have to send."""
    return _live_sums(order, [1] * len(order))


def live_bytes(order: list[torch.fx.Node], fraction: float) -> list[float]:
    """Bytes a cut in front of each position sends per chunk (`fraction` of the sequence)."""
    sizes = []
    for node in order:
        value = example_value(node)
        full = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        sizes.append(full * fraction)
    return _live_sums(order, sizes)


def _live_sums(order: list[torch.fx.Node], sizes: list) -> list:
    position = {n: i for i, n in enumerate(order)}
    diff = [0] * (len(order) + 2)
    for i, node in enumerate(order):
        end = max((position.get(u, len(order)) for u in node.users), default=-1)
        if end > i:
            diff[i + 1] += sizes[i]
            diff[min(end, len(order)) + 1] -= sizes[i]
    live, running = [], 0
    for delta in diff[:-1]:
        running += delta
        live.append(running)
    return live


# A stage this much heavier than an even share is worth sending more values at a cut (the
# pending long skips of a U-shaped model, say) for a better balance.
_IMBALANCE = 1.25


def _choose_cuts(weights: list[float], live: list[int], stages: int,
                 sends: list[float]) -> list[int]:
    """Cuts where the fewest token values are live, allowing up to 3 more where that is
    what it takes to balance the stages."""
    if stages == 1:
        return []
    inner = range(1, len(weights))
    floor = min(live[i] for i in inner) if len(weights) > 1 else 0
    fair, best = sum(weights) / stages, None
    for slack in range(0, 4):
        candidates = [i for i in inner if live[i] <= floor + slack]
        if len(candidates) < stages - 1:
            continue
        cuts = _balanced(weights, candidates, stages, sends)
        heaviest = _heaviest(weights, cuts, sends)
        if best is None or heaviest < best[0]:
            best = (heaviest, cuts)
        if heaviest <= _IMBALANCE * fair:
            break
    if best is None:
        raise TokpipeError(
            f"stages={stages} is more than this graph can be cut into: it has only "
            f"{len(candidates) + 1} places to cut the token stream cleanly; use fewer stages"
        )
    return best[1]


def _heaviest(weights: list[float], cuts: list[int], sends: list[float]) -> float:
    """The slowest stage: its compute plus the send at its end (the last stage sends none)."""
    bounds = [0, *cuts, len(weights)]
    return max(sum(weights[a:b]) + (sends[b] if b < len(weights) else 0.0)
               for a, b in pairwise(bounds))


def _balanced(weights: list[float], candidates: list[int], stages: int,
              sends: list[float]) -> list[int]:
    """Cuts (a subset of candidates, stages-1 of them) minimising the heaviest stage, a
    stage's cost being its compute plus the send at its end."""
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    points = [0, *candidates, len(weights)]
    inf = float("inf")
    # best[s][j]: minimal heaviest stage when the first s stages end at points[j].
    best = [[inf] * len(points) for _ in range(stages + 1)]
    back = [[0] * len(points) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(1, len(points)):
            for i in range(j):
                if best[s - 1][i] == inf:
                    continue
                send = sends[points[j]] if points[j] < len(weights) else 0.0
                cost = max(best[s - 1][i], prefix[points[j]] - prefix[points[i]] + send)
                if cost < best[s][j]:
                    best[s][j], back[s][j] = cost, i
    cuts, j = [], len(points) - 1
    for s in range(stages, 0, -1):
        j = back[s][j]
        cuts.append(points[j])
    return sorted(cuts)[1:]
