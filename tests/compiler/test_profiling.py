"""torch.profiler sees the pipeline: a range per stage, chunk and step, the whole-sequence
(warmup) steps marked, steps counted across calls, the K/V cache writes."""

from __future__ import annotations

import json

import pytest
from torch.profiler import ProfilerActivity, profile

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.runtime.executor import range_name
from tokpipe_compiler.runtime.kv_attention import CACHE_WRITE_RANGE
from tokpipe_compiler.runtime.schedule import COMPUTE, RECV, SEND, Action

STAGES, CHUNKS = 2, 4


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Three calls of an in-process 2-stage program, the last two profiled: a reset before
    the second makes it a warmup (whole-sequence) step, the third is chunked."""
    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    program = traced.program(stages=STAGES, chunks=CHUNKS, mode="stale", warmup_steps=1)
    program(*traced.inputs)  # step 0, unprofiled
    program.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        program(*traced.inputs)  # step 1: warmup again
        program(*traced.inputs)  # step 2: chunked
    path = tmp_path_factory.mktemp("profile") / "trace.json"
    prof.export_chrome_trace(str(path))
    return program, json.loads(path.read_text())


def _names(chrome: dict) -> list[str]:
    return [e["name"] for e in chrome["traceEvents"] if e.get("ph") == "X"]


def test_a_range_for_every_stage_and_chunk_of_a_chunked_step(profiled):
    _, chrome = profiled
    names = _names(chrome)
    for stage in range(STAGES):
        for chunk in range(CHUNKS):
            assert names.count(f"tokpipe/stage{stage}/chunk{chunk}/step2") == 1


def test_the_warmup_step_is_marked_whole(profiled):
    _, chrome = profiled
    names = _names(chrome)
    for stage in range(STAGES):
        assert names.count(f"tokpipe/stage{stage}/whole/step1") == 1
    assert not any("/chunk" in n and n.endswith("/step1") for n in names)


def test_steps_count_across_calls(profiled):
    program, chrome = profiled
    steps = {n.rsplit("/step", 1)[1] for n in _names(chrome)
             if n.startswith("tokpipe/stage")}
    assert steps == {"1", "2"}  # the unprofiled call was step 0
    assert [e.step for e in program.timeline.events if e.chunk == 0 and e.stage == 0] == \
        [0, 1, 2]


def test_cache_writes_have_their_range_inside_a_stage(profiled):
    _, chrome = profiled
    events = [e for e in chrome["traceEvents"] if e.get("ph") == "X"]
    writes = [e for e in events if e["name"] == CACHE_WRITE_RANGE]
    computes = [e for e in events if e["name"] == "tokpipe/stage1/chunk3/step2"]
    # two layers, one attention each, over 1 warmup and 4 chunked passes of the stages
    assert len(writes) == 2 * (1 + CHUNKS)
    (compute,) = computes
    assert any(compute["ts"] <= w["ts"] and w["ts"] + w["dur"] <= compute["ts"] + compute["dur"]
               for w in writes)


def test_send_and_receive_names_say_peer_and_value_count():
    send = Action(SEND, 0, 2, 1, peer=1)
    recv = Action(RECV, 0, 2, 1, peer=0)
    assert range_name(send, 5, whole=False, values=3) == \
        "tokpipe/stage0/chunk2/step5/send->rank1/3 values"
    assert range_name(recv, 5, whole=False, values=3) == \
        "tokpipe/stage0/chunk2/step5/recv<-rank0/3 values"
    assert range_name(Action(COMPUTE, 1, 0, 0), 0, whole=True) == "tokpipe/stage1/whole/step0"
