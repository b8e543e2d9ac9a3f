"""chunks="auto": a chunk table chosen from predicted stage times.

A stage time is seconds of one chunk on one stage as a function of (chunk tokens, context
tokens), e.g. `calibrate.time_fn` of the stage's Cost. Every stage is taken to run a chunk
at the pace of the chunk's slowest stage (t_i); `pipeline_time` then gives one call
sum(t_i) + (S - 1) * max(t_i), TeraPipe's objective, and a ring the time of all its steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tokpipe_compiler.costmodel import pipeline_time
from tokpipe_compiler.costmodel.slicing import choose_chunks, terapipe_slices
from tokpipe_compiler.runtime.chunking import Chunk, chunk_table, table_from_sizes

StageTime = Callable[[int, int], float]  # (chunk tokens, context tokens) -> seconds

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
    """Per chunk, the predicted seconds of its slowest stage."""
    def tok(u: int) -> int:
        return u * tokens // units

    return [max(t(tok(c.units), tok(c.stop) if causal else tokens) for t in stage_times)
            for c in table]


def table_step_time(
    table: Sequence[Chunk], stage_times: Sequence[StageTime], units: int, tokens: int,
    causal: bool,
) -> float:  # fmt: skip
    times = slowest_times(table, stage_times, units, tokens, causal)
    return step_time(times, len(stage_times))


def choose_stale(units: int, tokens: int, stage_times: Sequence[StageTime],
                 ring_steps: int | None = None) -> list[Chunk]:
    """The uniform table whose chunk count has the least predicted time: of one call, or,
    for a ring of `ring_steps` steps, of the whole ring (it fills once; with fewer chunks
    than stages each step waits for its chunks to come round)."""
    stages = len(stage_times)

    def predict(m: int) -> float:
        slowest = slowest_times(chunk_table(units, m), stage_times, units, tokens, False)
        return step_time(slowest, stages, ring_steps)

    low = min(stages, units)
    candidates = range(low, max(low, min(units, MAX_AUTO_STALE_CHUNKS)) + 1)
    return chunk_table(units, choose_chunks(units, stages, predict, candidates))


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

