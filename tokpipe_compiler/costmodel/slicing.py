"""How to cut a token sequence into pipeline chunks.

Pure functions over a time model; the cost pass and calibration supply the times, and
`pipeline_time` says what a pipelined step of the chunks takes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from itertools import pairwise

INF = math.inf


def _cut_points(total: int, granularity: int) -> list[int]:
    # Every multiple of the granularity, and `total` itself (the last slice may be short).
    points = list(range(0, total, granularity))
    return [*points, total]


def _times(points: list[int], time_fn: Callable[[int, int], float]) -> list[list[float]]:
    """times[j][i]: time of the slice points[i]..points[j] (i < j)."""
    return [[time_fn(end - start, end) for start in points[:j]] for j, end in enumerate(points)]


Choice = tuple[float, int]  # (least sum up to a point, the cut before it)


def _best_cut(row: list[float], column: list[float], bound: float) -> Choice:
    """Least row[i] + time of slice i..j over the starts i whose slice fits the bound."""
    options = ((row[i] + t, i) for i, t in enumerate(column) if t <= bound and row[i] < INF)
    return min(options, default=(INF, -1))


def _min_sum(
    times: list[list[float]], bound: float, max_slices: int | None
) -> tuple[float, list[int]]:
    """Least-seconds slicing with every slice time <= bound: (sum, cut indices)."""
    last = len(times) - 1
    if max_slices is None or max_slices >= last:
        best, parent = [0.0] + [INF] * last, [-1] * (last + 1)
        for j in range(1, last + 1):
            best[j], parent[j] = _best_cut(best, times[j], bound)
        return best[last], _trace(lambda m, j: parent[j], last, 0)
    # With a cap on the slice count, layer m holds slicings into exactly m slices.
    layers, parents = [[0.0] + [INF] * last], [[-1] * (last + 1)]
    for _ in range(max_slices):
        choices = [(INF, -1)] + [_best_cut(layers[-1], times[j], bound) for j in range(1, last + 1)]
        layers.append([value for value, _ in choices])
        parents.append([i for _, i in choices])
    count = min(range(1, max_slices + 1), key=lambda m: layers[m][last])
    return layers[count][last], _trace(lambda m, j: parents[m][j], last, count)


def _least_max(times: list[list[float]], max_slices: int | None) -> float:
    """The smallest max(t_i) any slicing reaches: a lower bound for the walk."""
    last = len(times) - 1

    def relax(prev: list[float], j: int) -> float:
        return min((max(prev[i], t) for i, t in enumerate(times[j])), default=INF)

    if max_slices is None or max_slices >= last:
        worst = [0.0] + [INF] * last
        for j in range(1, last + 1):
            worst[j] = relax(worst, j)
        return worst[last]
    layer, reach = [0.0] + [INF] * last, INF
    for _ in range(max_slices):
        layer = [INF] + [relax(layer, j) for j in range(1, last + 1)]
        reach = min(reach, layer[last])
    return reach


def _trace(parent: Callable[[int, int], int], last: int, count: int) -> list[int]:
    """Cut indices from 0 to last, following parent(m, j) back from (count, last)."""
    if parent(count, last) < 0:
        return []
    cuts, j, m = [last], last, count
    while j > 0:
        j = parent(m, j)
        cuts.append(j)
        m -= 1
    return cuts[::-1]


def terapipe_slices(
    total: int,
    stages: int,
    time_fn: Callable[[int, int], float],
    granularity: int = 1,
    max_slices: int | None = None,
    tolerance: float = 0.01,
) -> list[int]:
    """TeraPipe's slicing: minimise sum(t_i) + (stages - 1) * max(t_i), the time
    `pipeline_time.seconds` gives a call whose stages all take t_i on slice i.

    t_i = time_fn(l_i, end_i) for a slice of l_i tokens ending at token end_i (a causal
    slice attends to every token before end_i). Lengths are multiples of `granularity`
    except possibly the last; at most `max_slices` slices. For a bound on max(t_i), a DP
    minimises sum(t_i). The bound walks down from the largest slice time: each solution's
    own max w sets the next bound below w * (1 - tolerance), and the walk stops once no
    tighter bound can win. Skipping bounds within the tolerance costs at most
    (stages - 1) * tolerance * w over the optimum; tolerance=0 is exact.
    """
    if total < 1 or stages < 1 or granularity < 1:
        raise ValueError(
            f"need positive total, stages, granularity: {total}, {stages}, {granularity}"
        )
    points = _cut_points(total, granularity)
    times = _times(points, time_fn)
    candidates = sorted({t for row in times for t in row})
    floor = _least_max(times, max_slices)
    best_value, best_cuts = INF, []
    bound = candidates[-1]
    while True:
        total_time, cuts = _min_sum(times, bound, max_slices)
        if not cuts or total_time + (stages - 1) * floor >= best_value:
            break  # a tighter bound only raises the sum, and max(t_i) >= floor always
        worst = max(times[j][i] for i, j in pairwise(cuts))
        value = total_time + (stages - 1) * worst
        if value < best_value:
            best_value, best_cuts = value, cuts
        below = bisect.bisect_left(candidates, worst * (1 - tolerance))
        if below == 0:
            break
        bound = candidates[below - 1]
    return [points[j] - points[i] for i, j in pairwise(best_cuts)]


def choose_chunks(
    total_units: int,
    stages: int,
    step_time_fn: Callable[[int], float],
    candidates: Sequence[int] | None = None,
) -> int:
    """The chunk count M in 1..total_units with the least predicted pipelined step time.

    `stages` bounds the default candidates: fewer chunks than stages leave stages idle,
    so they are tried only when the grid has fewer units than stages.
    """
    if total_units < 1:
        raise ValueError(f"total_units must be >= 1, got {total_units}")
    if candidates is None:
        candidates = range(min(stages, total_units), total_units + 1)
    valid = sorted({m for m in candidates if 1 <= m <= total_units})
    if not valid:
        raise ValueError(f"no candidate chunk count in 1..{total_units}: {list(candidates)}")
    return min(valid, key=step_time_fn)
