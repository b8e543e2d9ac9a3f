"""partition: stage cut points in the token stream, balanced by cost.

Token-carrying nodes, in graph order, are cut into `stages` contiguous runs. A cut may fall
in front of any node where every live token value is a tensor (a cut sends them all). Two
passes choose the cuts:
  1. the best balance: the smallest possible slowest stage, a stage costing its compute
     plus the send of what is live at its end (bisection on that cost, greedy check);
  2. the cheapest cuts within a small slack of that balance: fewest bytes live at the cuts
     (a dynamic program), so a plan cuts on the residual stream between blocks where that
     balances about as well, and sends more only where balance needs it (the pending long
     skips of a U-shaped model, a stage boundary inside a block).
Invariant nodes belong to no stage: they run once per call in a prelude and are replicated
where used. A partition whose slowest stage is over `IMBALANCE_WARNING` of an even share
(one node heavier than a share, fewer nodes than stages) says so with a warning.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch.fx

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value, is_parameter, module_path
from tokpipe_compiler.core.logs import LOG
from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.passes.split import is_chunk_source

# Cuts may give up this share of an even stage of balance to send fewer bytes.
BALANCE_SLACK = 0.02
# A slowest stage over this multiple of an even share is reported.
IMBALANCE_WARNING = 1.10


# each imbalance warning said, its percentages left out, with its graph's weight shapes
IMBALANCES_SAID: set[tuple[str, tuple]] = set()


class ImbalanceWarning(UserWarning):
    """The stages cannot be balanced within IMBALANCE_WARNING of an even share."""


@dataclass(frozen=True)
class Partition:
    stage_of: dict[torch.fx.Node, int]  # every token-carrying node -> its stage
    cuts: tuple[int, ...]  # index into `order` of the first node of stages 1..S-1
    order: tuple[torch.fx.Node, ...]  # token-carrying nodes in graph order
    weights: tuple[float, ...]  # per-node weight used to balance (seconds or FLOPs)
    imbalance: float = 1.0  # the slowest stage's weight over an even share
    warning: str = ""  # why the stages are not balanced within IMBALANCE_WARNING


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
    sizes = live_bytes(order, chunk_fraction)
    sends = [flops_per_byte * b for b in sizes]
    allowed = cut_positions(order)
    cuts = _choose_cuts(weights, sizes, stages, sends, allowed)
    stage_of, stage = {}, 0
    for i, node in enumerate(order):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        stage_of[node] = stage
    imbalance, why = _imbalance(order, weights, cuts, stages, allowed, sends)
    if why:
        LOG.info("partition: %s", why)  # users see the warning; the log is for TOKPIPE_LOGS
        # once per model and layout, not per input shape: a server's new sizes re-plan one
        # model (its weights' shapes tell it from another of other widths)
        said = (re.sub(r"\d+%", "N%", why), _weight_shapes(gm))
        if said not in IMBALANCES_SAID:
            IMBALANCES_SAID.add(said)
            warn(f"tokpipe: {why}", ImbalanceWarning)
    return Partition(stage_of, tuple(cuts), tuple(order), tuple(weights), imbalance, why)


def _weight_shapes(gm: torch.fx.GraphModule) -> tuple:
    """The shapes of the graph's parameters and buffers, in order."""
    return tuple(tuple(getattr(example_value(n), "shape", ())) for n in gm.graph.nodes
                 if is_parameter(n))


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


def cut_positions(order: list[torch.fx.Node]) -> list[bool]:
    """allowed[i]: a cut in front of node i sends only tensors (not a tuple that getitems
    take apart later); i in 1..len(order)-1."""
    others = [0 if isinstance(example_value(n), torch.Tensor) else 1 for n in order]
    return [i > 0 and n == 0 for i, n in enumerate(_live_sums(order, others))]


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


def _choose_cuts(weights: list[float], sizes: list[float], stages: int, sends: list[float],
                 allowed: list[bool] | None = None) -> list[int]:
    """stages-1 cuts (positions in 1..n-1 where `allowed`): the slowest stage (compute plus
    the send at its end) within BALANCE_SLACK of an even share of the best possible, and
    among those, the fewest `sizes` (bytes live) summed over the cuts."""
    if stages == 1:
        return []
    n = len(weights)
    allowed = allowed or [0 < i < n for i in range(n + 1)]
    points = [i for i in range(1, n) if allowed[i]]
    if len(points) < stages - 1:
        raise TokpipeError(
            f"stages={stages} is more than this graph can be cut into: it has only "
            f"{len(points) + 1} places to cut the token stream cleanly; use fewer stages")
    prefix = _prefix(weights)
    best = _min_slowest(prefix, sends, points, stages)
    limit = best + BALANCE_SLACK * prefix[-1] / stages
    while True:
        cuts = _fewest_bytes(prefix, sends, sizes, points, stages, limit)
        if cuts is not None:
            return cuts
        limit *= 1.05  # sends made some stage count impossible at this limit: relax


def _prefix(weights: list[float]) -> list[float]:
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    return prefix


def _stage_cost(prefix: list[float], sends: list[float], a: int, b: int) -> float:
    """Nodes a..b-1: their weight plus the send at b (none after the last node)."""
    return prefix[b] - prefix[a] + (sends[b] if b < len(prefix) - 1 else 0.0)


def _min_slowest(prefix: list[float], sends: list[float], points: list[int],
                 stages: int) -> float:
    """The smallest slowest-stage cost over cuts at `points`, by bisection."""
    lo, hi = 0.0, _stage_cost(prefix, sends, 0, len(prefix) - 1) + max(sends, default=0.0)
    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _fits(prefix, sends, points, stages, mid) else (mid, hi)
    return hi


def _fits(prefix: list[float], sends: list[float], points: list[int], stages: int,
          limit: float) -> bool:
    """Whether at most `stages` stages of cost <= limit cover the nodes: each stage ends at
    the furthest point it can (a later start only makes the rest cheaper)."""
    n, start = len(prefix) - 1, 0
    for _ in range(stages):
        if prefix[n] - prefix[start] <= limit:
            return True
        reach = bisect.bisect_right(prefix, prefix[start] + limit) - 1  # compute alone
        k = bisect.bisect_right(points, reach) - 1
        while k >= 0 and points[k] > start and \
                _stage_cost(prefix, sends, start, points[k]) > limit:
            k -= 1
        if k < 0 or points[k] <= start:
            return False
        start = points[k]
    return False


def _fewest_bytes(prefix: list[float], sends: list[float], sizes: list[float],
                  points: list[int], stages: int, limit: float) -> list[int] | None:
    """Cuts with every stage <= limit and the fewest bytes live at them, None if there are
    none. best[j]: fewest bytes over cuts ending a stage at ends[j]; a stage ending at b
    may start at any earlier end a with prefix[a] >= prefix[b] + send[b] - limit, a range
    whose minimum a sparse table answers."""
    n = len(prefix) - 1
    limit *= 1 + 1e-12  # the bisection's bound, met with rounding
    ends = [0, *points, n]
    ideal = prefix[-1] / stages
    inf = float("inf")
    best = [0.0] + [inf] * (len(ends) - 1)
    back: list[list[int]] = []
    for s in range(1, stages + 1):
        # Ties (equal bytes) go to the cut nearest its even share of the weight.
        keys = [(best[j], abs(prefix[ends[j]] - (s - 1) * ideal), j) for j in range(len(ends))]
        table = _SparseMin(keys)
        new, choice = [inf] * len(ends), [-1] * len(ends)
        for j in range(1, len(ends)):
            if (s == stages) != (j == len(ends) - 1):
                continue  # the last stage ends at n, no other does
            b = ends[j]
            lowest = prefix[b] + (sends[b] if b < n else 0.0) - limit
            first = bisect.bisect_left(prefix, lowest)
            i = bisect.bisect_left(ends, first)
            if i >= j:
                continue
            value, _, arg = table.query(i, j)
            if value < inf:
                new[j], choice[j] = value + (sizes[b] if b < n else 0.0), arg
        best = new
        back.append(choice)
    if best[-1] == inf:
        return None
    cuts, j = [], len(ends) - 1
    for s in range(stages - 1, 0, -1):
        j = back[s][j]
        cuts.append(ends[j])
    return sorted(cuts)


class _SparseMin:
    """Range minimum of a fixed list in O(1) per query after O(n log n) building."""

    def __init__(self, keys: list[tuple]):
        self.levels = [keys]
        width = 1
        while 2 * width <= len(keys):
            last = self.levels[-1]
            self.levels.append([min(last[i], last[i + width])
                                for i in range(len(keys) - 2 * width + 1)])
            width *= 2

    def query(self, lo: int, hi: int) -> tuple:
        """min(keys[lo:hi]), hi > lo."""
        level = (hi - lo).bit_length() - 1
        row = self.levels[level]
        return min(row[lo], row[hi - (1 << level)])


def _imbalance(order: list[torch.fx.Node], weights: list[float], cuts: list[int],
               stages: int, allowed: list[bool], sends: list[float]) -> tuple[float, str]:
    """The slowest stage's compute over an even share, and why it is past the warning
    threshold ('' when it is not)."""
    total = sum(weights)
    if not total > 0:  # nothing to balance (an empty batch: every weight 0, or NaN)
        return 1.0, ""
    bounds = [0, *cuts, len(weights)]
    share = total / stages
    ratio = max(sum(weights[a:b]) for a, b in pairwise(bounds)) / share
    if ratio <= IMBALANCE_WARNING:
        return ratio, ""
    # The pieces no cut can fall inside bound the balance from below.
    ends = [0, *(i for i in range(1, len(weights)) if allowed[i]), len(weights)]
    a, b = max(pairwise(ends), key=lambda p: sum(weights[p[0]:p[1]]))
    piece = sum(weights[a:b]) / share
    what = f"one node, {_named(order[a])}," if b - a == 1 else (
        f"nodes {_named(order[a])}..{_named(order[b - 1])} (no cut may fall between them),")
    why = (f"{stages} stages cannot be balanced: the slowest carries {ratio - 1:.0%} more than "
           f"an even share; the heaviest piece, {what} is {piece:.0%} of a share")
    if any(sends[i] for i in cuts):
        why += ", and the sends at the cuts count as compute"
    return ratio, why + "; use fewer stages"


def _named(node: torch.fx.Node) -> str:
    """A node as the user can find it: its module ('transformer_blocks.0.ff'), its op and
    name; the name alone ('hidden_states_16') says little."""
    where = module_path(node)
    op = getattr(node.target, "__name__", str(node.target))
    return f"{op} in {where} ({node.name})" if where else f"{op} ({node.name})"
