"""The timeline of a real run as a Chrome trace, and measured against predicted."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.costmodel.calibrate import DeviceRates
from tokpipe_compiler.inspection.timeline import (
    StageTiming,
    chrome_trace,
    compare,
    format_comparison,
    steady_steps,
    write_chrome_trace,
)
from tokpipe_compiler.runtime import timeline_events
from tokpipe_compiler.runtime.timeline_events import Event

RATES = DeviceRates(matmul_flops=1e10, mem_bandwidth=1e10, attention_flops=1e10,
                    per_op_overhead=1e-6)


def ran_program(calls: int = 6):
    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    program = traced.program(stages=2, chunks=4, mode="stale")
    for _ in range(calls):
        program(*traced.inputs)
    return program


def test_chrome_trace_follows_the_format(tmp_path):
    program = ran_program()
    path = write_chrome_trace(program.timeline, tmp_path / "trace.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(program.timeline.events) == 2 * (1 + 5 * 4)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= set(names)
    assert any(e["name"] == "process_name" and e["pid"] == 0 for e in events)
    # Chunked computes record their rows; the warmup call ran the whole grid at once.
    assert sorted({e["args"]["units"] for e in complete}) == [1, 4]
    starts = [e["ts"] for e in complete]
    assert starts == sorted(starts)


def test_the_timeline_keeps_its_latest_events_only(monkeypatch):
    """A process making image after image keeps a bounded record: the latest events."""
    monkeypatch.setattr(timeline_events, "TIMELINE_EVENTS", 8)
    program = ran_program(calls=3)
    events = list(program.timeline.events)
    assert len(events) == 8
    # the last call's: its last chunk, stage 1's compute the very last
    assert events[-1].step == 2 and events[-1].stage == 1 and events[-1].chunk == 3
    assert program.timeline.events.maxlen == 8


def test_measured_against_predicted_per_stage():
    program = ran_program()
    no_launch_cost = dataclasses.replace(RATES, per_op_overhead=0.0)
    rows = compare(program.plan, program.timeline, no_launch_cost)
    assert [r.stage for r in rows] == [0, 1]
    # Steps 1-5 chunked: the first compiles, the later half of the rest is timed.
    assert all(r.steps == (4, 5) and r.samples == 2 * 4 for r in rows)
    assert all(r.measured_s > 0 and r.predicted_s > 0 for r in rows)
    text = format_comparison(rows)
    assert "measured/predicted" in text and len(text.splitlines()) >= 4
    assert "  4-5 " in text


def timing(measured_ms: float, predicted_ms: float = 1.0, overhead_ms: float = 0.01):
    return StageTiming(0, 8, measured_ms / 1e3, predicted_ms / 1e3, overhead_ms / 1e3, 16,
                       (4, 5))


def test_measured_time_far_beyond_the_prediction_is_op_overhead():
    """The calibrated cost per op (a bare add) is far below an eager stage's: a chunk that
    runs 11x its predicted compute time is bound by launching ops, not by computing (it
    was called compute/memory bound)."""
    assert not timing(1.2).overhead_bound
    assert timing(11.0).overhead_bound
    assert "fewer chunks, or Inductor stages" in format_comparison([timing(11.0)])
    compiled = format_comparison([timing(11.0)], compiler="inductor")
    assert "fewer chunks, or CUDA graphs" in compiled and "Inductor" not in compiled
    whole = format_comparison([dataclasses.replace(timing(11.0), whole=True)])  # sync
    assert "a whole step of" in whole and "fewer stages" in whole
    assert "chunk" not in whole.split("\n", 1)[1]  # sync runs no chunks to make fewer
    unmeasured = dataclasses.replace(timing(11.0), steps=(), steps_short=2)
    assert not unmeasured.overhead_bound  # by the prediction alone


def test_a_time_far_beyond_any_launch_cost_points_at_busy_cores():
    """235x the prediction on cores another job held: the advice was fewer chunks, where
    one thread on the free core measured 1.5x."""
    assert "--threads 1" not in format_comparison([timing(11.0)])
    assert "--threads 1" in format_comparison([timing(235.0)])


def test_a_chunk_bound_by_op_launches_is_named():
    """With 1 ms per op launch, a tiny stage's chunk is nearly all launch cost: the table
    says so, with the chunk's token count and what to do."""
    program = ran_program()
    slow_launches = DeviceRates(matmul_flops=1e10, mem_bandwidth=1e10, attention_flops=1e10,
                                per_op_overhead=1e-3)
    rows = compare(program.plan, program.timeline, slow_launches)
    assert all(r.overhead_bound for r in rows)
    text = format_comparison(rows)
    assert "op overhead" in text
    assert f"a chunk of {program.plan.chunk_tokens(program.plan.chunks[0])} tokens" in text
    assert "fewer chunks" in text


def test_empty_timeline():
    assert chrome_trace([])["traceEvents"] == []


def compute(stage: int, step: int, units: int, seconds: float, chunk: int = 0) -> Event:
    return Event("compute", 0, stage, chunk, step, float(step), seconds, units)


def test_compiling_steps_are_left_out_of_the_measured_time():
    """Inductor compiles in a chunk length's first chunked step (seconds), and the steps just
    after it still run slow (as a 2-core machine measured them): the measured median is the
    steady steps', not theirs."""
    events = [compute(0, 0, 4, 12.0)]  # the warmup step, whole
    for step in range(1, 6):
        seconds = 0.15 if step <= 3 else 0.0004
        events += [compute(0, step, 1, 6.8 if (step, chunk) == (1, 0) else seconds, chunk)
                   for chunk in range(4)]
    steps, short = steady_steps([e for e in events if e.units == 1])
    assert (steps, short) == ([4, 5], 0)
    (row,) = compare(ran_program(calls=1).plan, events, RATES)
    assert row.steps == (4, 5) and row.samples == 8
    assert row.measured_s == pytest.approx(0.0004)


def test_too_few_steady_steps_give_no_figure():
    """Two chunked calls (the --run 3 of a stale plan with one warmup step): the only step
    after the compiling one is no steady figure; the table says how many more to run."""
    events = [compute(0, 0, 4, 12.0), compute(0, 1, 1, 6.8), compute(0, 2, 1, 0.15)]
    (row,) = compare(ran_program(calls=1).plan, events, RATES)
    assert math.isnan(row.measured_s) and row.steps == () and row.steps_short == 2
    text = format_comparison([row])
    assert "measured/predicted" in text and " 150.000 " not in text
    assert "stage(s) 0: too few steps to measure" in text
    assert "run at least 2 more chunked step(s)" in text


def test_a_rank_compares_only_the_stage_it_runs():
    """Rank 1 of two runs stage 1 only: stage 0 is neither a NaN row nor named in the
    footer as too small."""
    events = [compute(1, step, 1 if step else 4, 0.001) for step in range(6)]
    slow_launches = dataclasses.replace(RATES, per_op_overhead=1e-3)
    rows = compare(ran_program(calls=1).plan, events, slow_launches)
    assert [r.stage for r in rows] == [1]
    text = format_comparison(rows)
    assert "stage(s) 1: a chunk" in text and "nan" not in text
    assert format_comparison([]).startswith("no stage computed anything")
