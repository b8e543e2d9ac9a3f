"""The schedule (runtime/schedule.py) on hand-built layouts: what it contains, what the
checker rejects, and its string form. No Dynamo."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.schedule import (
    COMPUTE,
    RECV,
    SEND,
    build_schedule,
    check_schedule,
    parse_schedule,
)

LAYOUTS = [  # stages, chunks, steps, world, consumers, carries
    (1, 1, 1, 1, None, None),
    (2, 4, 1, 2, None, None),
    (3, 5, 2, 3, None, None),
    (3, 2, 3, 1, None, None),
    (4, 3, 1, 4, {0: {1, 3}, 1: {2}, 2: {3}}, None),  # a skip connection
    (2, 4, 3, 2, None, {1: {0}}),  # ring
    (3, 2, 4, 3, None, {2: {0, 2}}),  # ring whose carry is also read by the last stage
    (2, 3, 2, 1, None, {1: {0}}),  # a ring in one process: no messages
]


def layout_schedule(stages, chunks, steps, world, consumers, carries):
    return build_schedule(stages, chunks, world=world, steps=steps, consumers=consumers,
                          carries=carries)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_chunk_passes_every_stage_once_per_step_in_order(layout):
    stages, chunks, steps, world, _, _ = layout
    schedule = layout_schedule(*layout)
    assert len(schedule.ranks) == world
    computes = [(a.step, a.stage, a.chunk) for acts in schedule.ranks for a in acts
                if a.kind == COMPUTE]
    assert sorted(computes) == list(itertools.product(range(steps), range(stages),
                                                      range(chunks)))
    for rank, acts in enumerate(schedule.ranks):
        mine = [(a.step, a.chunk) for a in acts if a.kind == COMPUTE]
        assert mine == sorted(mine), rank  # steps, then chunks, in order on every rank
        assert all(schedule.stage_rank[a.stage] == rank for a in acts if a.kind == COMPUTE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_messages_cross_ranks_and_come_before_their_use(layout):
    stages, chunks, steps, world, consumers, carries = layout
    schedule = layout_schedule(*layout)
    consumers = consumers or {s: {s + 1} for s in range(stages - 1)}
    expected_sends = sum(1 for s, ds in consumers.items() for _ in ds) * chunks * steps
    # A carry read by the stage that makes it stays on its rank.
    carried = sum(d != s for s, ds in (carries or {}).items() for d in ds) * chunks * (steps - 1)
    sends = [a for acts in schedule.ranks for a in acts if a.kind == SEND]
    assert len(sends) == (expected_sends + carried if world > 1 else 0)
    for rank, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if a.kind == RECV:  # the compute that reads it follows on the same rank
                assert any(b.kind == COMPUTE and (b.step, b.chunk) == (a.step, a.chunk)
                           for b in acts[i + 1:])
            if a.kind in (SEND, RECV):
                assert a.peer != rank


def test_the_distributed_form():
    schedule = build_schedule(2, 2, world=2, steps=2, carries={1: {0}})
    assert str(schedule) == (
        "rank 0: C0.0 S0.0>1 C0.1 S0.1>1 1:R1.0<<1 1:C0.0 1:S0.0>1 1:R1.1<<1 1:C0.1 1:S0.1>1\n"
        "rank 1: R0.0<0 C1.0 S1.0>>0 R0.1<0 C1.1 S1.1>>0 1:R0.0<0 1:C1.0 1:R0.1<0 1:C1.1")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_string_form_round_trips(layout):
    stages, chunks, steps, *_ = layout
    schedule = layout_schedule(*layout)
    assert parse_schedule(str(schedule), stages, chunks, steps) == schedule


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 4), chunks=st.integers(1, 4), steps=st.integers(1, 3),
       distributed=st.booleans(), ring=st.booleans())
def test_any_layout_is_checked_and_round_trips(stages, chunks, steps, distributed, ring):
    schedule = build_schedule(stages, chunks, world=stages if distributed else 1, steps=steps,
                              carries={stages - 1: {0}} if ring else None)
    check_schedule(schedule)
    assert parse_schedule(str(schedule), stages, chunks, steps) == schedule


GOOD = """
rank 0: C0.0 S0.0>1 C0.1 S0.1>1 1:C0.0 1:S0.0>1 1:C0.1 1:S0.1>1
rank 1: R0.0<0 C1.0 R0.1<0 C1.1 1:R0.0<0 1:C1.0 1:R0.1<0 1:C1.1
"""


@pytest.mark.parametrize(("broken", "why", "marked"), [
    (GOOD.replace("1:C0.0 1:S0.0>1 1:C0.1", "1:C0.1 1:S0.0>1 1:C0.0"),
     "step 1: expected chunk 0 of stage 0", ">>1:C0.1<<"),
    (GOOD.replace("1:R0.1<0 1:C1.1", ""), "step 1: stage 1 runs chunks 0..0 of 0..1", None),
    (GOOD.replace(" 1:R0.1<0", ""), "step 1: no rank receives this send", ">>1:S0.1>1<<"),
    (GOOD.replace("1:S0.0>1 ", ""), "step 1: no rank sends what this receives",
     ">>1:R0.0<0<<"),
    (GOOD.replace("rank 1: R0.0<0 C1.0", "rank 1: R0.0<0 C0.0"),  # stage 0 again, elsewhere
     "step 0: expected chunk 2 of stage 0 on rank 0", ">>C0.0<<"),
])
def test_the_checker_marks_the_failing_step(broken, why, marked):
    check_schedule(parse_schedule(GOOD, 2, 2, 2))  # the unbroken one passes
    with pytest.raises(TokpipeError) as err:
        check_schedule(parse_schedule(broken, 2, 2, 2))
    assert why in str(err.value)
    assert marked is None or marked in str(err.value)


def test_bad_words_and_worlds_are_refused():
    with pytest.raises(TokpipeError, match="not a schedule action"):
        parse_schedule("rank 0: C0.0 X1", 1, 1)
    with pytest.raises(TokpipeError, match="world size 3"):
        build_schedule(2, 2, world=3)
