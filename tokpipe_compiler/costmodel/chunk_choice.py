"""chunks="auto": a chunk table chosen from predicted stage times.

A stage time is seconds of one chunk on one stage as a function of (chunk tokens, context
tokens), e.g. `calibrate.time_fn` of the stage's Cost. Every stage is taken to run a chunk
at the pace of the chunk's slowest stage (t_i); `pipeline_time` then gives one call
sum(t_i) + (S - 1) * max(t_i), TeraPipe's objective, and a ring the time of all its steps.

With joint attention's text computed once a step (text_chunks="first"), the first chunk
carries the text on top of its image rows, so an even table is uneven in time; each count
M is also tried with a lighter first chunk that evens it out (Flux at 512 px, M = 2:
512 text + 512 image tokens against 512 image tokens, a ring waits on the first chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tokpipe_compiler.costmodel import pipeline_time
from tokpipe_compiler.costmodel.slicing import choose_chunks, terapipe_slices
from tokpipe_compiler.runtime.chunking import (
    Chunk,
    chunk_table,
    table_from_sizes,
    with_first_segments,
)

# (chunk tokens, context tokens[, share of the text segments, 1 by default]) -> seconds
StageTime = Callable[..., float]

MAX_CUT_POINTS = 64  # the slicing DP is quadratic in cut points (cubic with a count cap)
# chunks="auto" in causal mode makes at most this many chunks: more, smaller chunks cost more
# in per-chunk runtime overhead, which the cost model does not see, than the model says they
# save (measured in BENCHMARKS.md).
MAX_AUTO_CAUSAL_CHUNKS = 16
# chunks="auto" in stale mode tries at most this many chunks: each count is a replayed
# schedule, and a token-sequence grid (Flux's packed latents, LTX) has thousands of units,
# which took minutes per plan; past 64 chunks per-chunk overhead dominates anyway.
MAX_AUTO_STALE_CHUNKS = 64


def step_time(slowest: Sequence[float], stages: int, ring_steps: int | None = None) -> float:
    """Predicted seconds of one pipelined call (or of a ring of `ring_steps` steps) whose
    chunks' slowest stages take `slowest`."""
    compute = [list(slowest)] * stages
    if ring_steps is None:
        return pipeline_time.seconds(compute)
    return pipeline_time.seconds(compute, ring_steps, ring=True)


def slowest_times(
    table: Sequence[Chunk], stage_times: Sequence[StageTime], units: int, tokens: int,
    causal: bool,
) -> list[float]:  # fmt: skip
    """Per chunk, the predicted seconds of its slowest stage (with the text segments where
    the chunk computes them)."""
    def tok(u: int) -> int:
        return u * tokens // units

    return [max(t(tok(c.units), tok(c.stop) if causal else tokens, float(c.segments))
                for t in stage_times)
            for c in table]


def table_step_time(
    table: Sequence[Chunk], stage_times: Sequence[StageTime], units: int, tokens: int,
    causal: bool,
) -> float:  # fmt: skip
    times = slowest_times(table, stage_times, units, tokens, causal)
    return step_time(times, len(stage_times))


def choose_stale(units: int, tokens: int, stage_times: Sequence[StageTime],
                 ring_steps: int | None = None, text_once: bool = False) -> list[Chunk]:
    """The table with the least predicted time: of one call, or, for a ring of `ring_steps`
    steps, of the whole ring (it fills once; with fewer chunks than stages each step waits
    for its chunks to come round). Tables are even; with `text_once` (the first chunk
    computes the text segments) each count is also tried with a lighter first chunk."""
    stages = len(stage_times)

    def predict(table: list[Chunk]) -> float:
        slowest = slowest_times(table, stage_times, units, tokens, False)
        return step_time(slowest, stages, ring_steps)

    def tables(m: int) -> list[list[Chunk]]:
        even = chunk_table(units, m)
        if not text_once or m == 1:
            return [even]
        return [with_first_segments(even),
                with_first_segments(lighter_first(units, m, tokens, stage_times))]

    low = min(stages, units)
    candidates = range(low, max(low, min(units, MAX_AUTO_STALE_CHUNKS)) + 1)
    best = choose_chunks(units, stages, lambda m: min(map(predict, tables(m))), candidates)
    return min(tables(best), key=predict)


def lighter_first(units: int, chunks: int, tokens: int,
                  stage_times: Sequence[StageTime]) -> list[Chunk]:
    """`chunks` chunks whose first, which also computes the text segments, has as many grid
    units as keep its slowest stage within the time of the others (their units split
    evenly), at least one."""
    def tok(u: int) -> int:
        return u * tokens // units

    def first_fits(u0: int) -> bool:
        rest = -(-(units - u0) // (chunks - 1))
        first = max(t(tok(u0), tokens, 1.0) for t in stage_times)
        return first <= max(t(tok(rest), tokens, 0.0) for t in stage_times)

    low, high = 1, units // chunks  # first_fits falls as u0 grows: the most units that fit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if first_fits(mid) else (low, mid - 1)
    rest = chunk_table(units - low, chunks - 1)
    return table_from_sizes([low] + [c.units for c in rest])


def choose_causal(
    units: int, tokens: int, stage_times: Sequence[StageTime], max_slices: int | None = None
) -> list[Chunk]:
    """TeraPipe's slicing: later chunks attend over more context, so they are shorter.
    At most `max_slices` chunks (default MAX_AUTO_CAUSAL_CHUNKS)."""
    def slowest(length: int, end: int) -> float:
        return max(t(length * tokens // units, end * tokens // units) for t in stage_times)

    granularity = math.ceil(units / MAX_CUT_POINTS)
    cap = MAX_AUTO_CAUSAL_CHUNKS if max_slices is None else max_slices
    sizes = terapipe_slices(units, len(stage_times), slowest, granularity, cap)
    return table_from_sizes(sizes)

