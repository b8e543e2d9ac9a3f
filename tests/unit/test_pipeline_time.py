"""The one time model (costmodel/pipeline_time.py) on hand-built stage times, no Dynamo."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpipe_compiler.costmodel.chunk_choice import step_time
from tokpipe_compiler.costmodel.pipeline_time import boxes, chain, seconds
from tokpipe_compiler.inspection.charts import predicted_boxes
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.schedule import build_schedule


def equal(stages: int, chunks: int, t: float = 1.0) -> list[list[float]]:
    return [[t] * chunks for _ in range(stages)]


@pytest.mark.parametrize(("stages", "chunks"), [(1, 1), (1, 4), (2, 4), (3, 5), (4, 2), (4, 8)])
def test_one_call_is_m_plus_s_minus_1_chunk_times(stages, chunks):
    t = 0.25
    assert seconds(equal(stages, chunks, t)) == pytest.approx((chunks + stages - 1) * t)
    # Calls run back to back: each pays the fill and the drain again.
    assert seconds(equal(stages, chunks, t), steps=3) == pytest.approx(
        3 * (chunks + stages - 1) * t)


@pytest.mark.parametrize(("stages", "chunks"), [(1, 3), (2, 2), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 20])
def test_ring_fills_once(stages, chunks, steps):
    """Chunks >= stages: K M t + (S - 1) t, the fill paid once for all steps."""
    t = 0.5
    total = seconds(equal(stages, chunks, t), steps, ring=True)
    assert total == pytest.approx((steps * chunks + stages - 1) * t)


@pytest.mark.parametrize(("stages", "chunks"), [(2, 1), (4, 2), (8, 4)])
def test_ring_with_fewer_chunks_than_stages_waits_for_them(stages, chunks):
    """Each chunk needs S chunk times to come round: a step takes S t, not M t."""
    steps = 20
    total = seconds(equal(stages, chunks), steps, ring=True)
    assert total == pytest.approx(steps * stages + chunks - 1)
    assert total > steps * chunks + stages - 1


def test_the_slowest_stage_sets_the_pace():
    # Stage 0 takes 2, stage 1 takes 1: 2 + 2 for stage 0, then stage 1 drains the last.
    assert seconds([[2.0, 2.0], [1.0, 1.0]]) == 5.0
    base = seconds(equal(4, 4), 19, ring=True)
    assert seconds([[1.0] * 4, [2.0] * 4, [1.0] * 4, [1.0] * 4], 19, ring=True) > base
    assert seconds(equal(4, 4), 20, ring=True) > base
    assert seconds([[2.0] * 4], 20, ring=True) == pytest.approx(160.0)


def test_a_send_holds_its_rank_and_delays_the_receiver():
    send = [[0.5, 0.5], [0.0, 0.0]]
    got = sorted((b.stage, b.chunk, b.start, b.end) for b in boxes(equal(2, 2), send=send))
    assert got == [(0, 0, 0.0, 1.0), (0, 1, 1.5, 2.5), (1, 0, 1.5, 2.5), (1, 1, 3.0, 4.0)]
    assert seconds(equal(4, 4), 19, ring=True, send=equal(4, 4, 0.1)) > seconds(
        equal(4, 4), 19, ring=True)


@settings(max_examples=40, deadline=None)
@given(slowest=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=7), stages=st.integers(1, 5))
def test_one_call_at_the_slowest_pace_is_terapipes_objective(slowest, stages):
    """Every stage at its chunk's slowest time: sum(t) + (S - 1) max(t)."""
    objective = sum(slowest) + (stages - 1) * max(slowest)
    assert step_time(slowest, stages) == pytest.approx(objective)
    assert seconds([slowest] * stages) == pytest.approx(objective)


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 4), chunks=st.integers(1, 4), steps=st.integers(4, 7),
       data=st.data())
def test_a_ring_replayed_from_three_steps_equals_the_whole_schedule(stages, chunks, steps, data):
    times = st.lists(st.lists(st.floats(0.0, 3.0), min_size=chunks, max_size=chunks),
                     min_size=stages, max_size=stages)
    compute, send = data.draw(times), data.draw(times)

    def whole(_, carries):  # every step of the ring, not the 3-step template
        return build_schedule(stages, chunks, world=stages, steps=steps, carries=carries)

    def key(box):
        return box.step, box.stage, box.chunk

    short = sorted(boxes(compute, steps, ring=True, send=send), key=key)
    full = sorted(boxes(compute, steps, ring=True, send=send, schedule_for=whole), key=key)
    assert [(b.start, b.end) for b in short] == pytest.approx([(b.start, b.end) for b in full])


def test_every_compute_once_on_its_rank_in_chunk_order():
    got = boxes([[1.0, 2.0, 3.0], [2.0, 1.0, 1.0], [1.0, 1.0, 2.0]], steps=2, ring=True)
    assert sorted((b.step, b.stage, b.chunk) for b in got) == list(
        itertools.product(range(2), range(3), range(3)))
    for stage in range(3):
        mine = sorted((b.start, b.end) for b in got if b.stage == stage)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))  # one rank, no overlap
    assert all(b.rank == b.stage for b in got)


class HandPlan:
    """What charts read of a Plan, with FLOPs given by hand: the Plan's own methods."""

    def __init__(self, flops: list[list[float]], consumers: dict[int, set[int]]):
        self.flops, self.consumers, self._schedules = flops, consumers, {}
        self.stages, self.chunks = list(range(len(flops))), list(range(len(flops[0])))

    def chunk_flops(self) -> list[list[float]]:
        return self.flops

    schedule = Plan.schedule
    predicted_boxes = Plan.predicted_boxes


@pytest.mark.parametrize("consumers", [{0: {1}, 1: {2}}, {0: {1, 2}, 1: {2}}])
def test_charts_boxes_are_the_time_model(consumers):
    flops = [[4.0, 4.0, 2.0, 2.0], [8.0, 8.0, 4.0, 4.0], [4.0, 4.0, 2.0, 2.0]]
    plan = HandPlan(flops, consumers)
    drawn = predicted_boxes(plan, steps=2)  # FLOPs scaled: the largest chunk takes 1
    scaled = [[f / 8.0 for f in row] for row in flops]
    assert max(b.end for b in drawn) == pytest.approx(seconds(scaled, steps=2))
    assert max(b.end for b in drawn) == pytest.approx(2 * (0.5 + 1 + 1 + 0.5 + 0.5 + 0.25))
    skip = build_schedule(3, 4, world=3, consumers=consumers)
    assert sorted(drawn, key=lambda b: (b.step, b.stage, b.chunk)) == sorted(
        boxes(scaled, 2, schedule_for=lambda *_: skip), key=lambda b: (b.step, b.stage, b.chunk))
    assert chain(3, 4)(1, None).ranks == build_schedule(3, 4, world=3).ranks


class ModePlan(HandPlan):
    def __init__(self, flops, mode: str, warmup_steps: int = 1):
        super().__init__(flops, {0: {1}})
        self.config = type("Config", (), {"mode": mode, "warmup_steps": warmup_steps})()


def test_schedule_chart_draws_warmup_whole_and_can_draw_the_ring():
    """Stale: the warmup step is one box per stage over the whole sequence, stage after
    stage; the chunked steps follow, per call or as one ring (shorter: no drain between
    steps). Sync: every step whole."""
    from tokpipe_compiler.inspection.charts import WHOLE, schedule_boxes

    flops = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    per_call = schedule_boxes(ModePlan(flops, "stale"), steps=3)
    whole = [b for b in per_call if b.chunk == WHOLE]
    assert [(b.stage, b.step, b.start, b.end) for b in whole] == [(0, 0, 0.0, 4.0),
                                                                  (1, 0, 4.0, 8.0)]
    chunked = [b for b in per_call if b.chunk != WHOLE]
    assert {b.step for b in chunked} == {1, 2} and min(b.start for b in chunked) == 8.0
    assert len(chunked) == 2 * 2 * 4
    ring = schedule_boxes(ModePlan(flops, "stale"), steps=3, ring=True)
    assert max(b.end for b in ring) < max(b.end for b in per_call)
    sync = schedule_boxes(ModePlan(flops, "sync"), steps=2)
    assert all(b.chunk == WHOLE for b in sync) and len(sync) == 2 * 2
