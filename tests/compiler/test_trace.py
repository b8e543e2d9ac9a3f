"""The timeline of a real run as a Chrome trace, and measured against predicted."""

from __future__ import annotations

import dataclasses
import json

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.costmodel.calibrate import DeviceRates
from tokpipe_compiler.inspection.timeline import (
    chrome_trace,
    compare,
    format_comparison,
    write_chrome_trace,
)

RATES = DeviceRates(matmul_flops=1e10, mem_bandwidth=1e10, attention_flops=1e10,
                    per_op_overhead=1e-6)


def ran_program(calls: int = 3):
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
    assert len(complete) == len(program.timeline.events) == 2 * (1 + 2 * 4)
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


def test_measured_against_predicted_per_stage():
    program = ran_program()
    no_launch_cost = dataclasses.replace(RATES, per_op_overhead=0.0)
    rows = compare(program.plan, program.timeline, no_launch_cost)
    assert [r.stage for r in rows] == [0, 1]
    assert all(r.samples == 2 * 4 for r in rows)  # two chunked calls, the warmup left out
    assert all(r.measured_s > 0 and r.predicted_s > 0 for r in rows)
    text = format_comparison(rows)
    assert "measured/predicted" in text and len(text.splitlines()) == 3
    assert "compute/memory" in text and "too small" not in text


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
