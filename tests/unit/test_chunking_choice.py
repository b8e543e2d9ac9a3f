"""chunks="auto": chosen tables from predicted stage times, and exactness with them."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.compiler.test_semantics import dit_inputs, eager, traced_causal, traced_dit
from tests.fixtures.tracing import assert_rel_close
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.costmodel.chunk_choice import (
    choose_causal,
    choose_stale,
    lighter_first,
    step_time,
)

# Fixed rates of a modest CPU: tests never measure the machine they run on.
RATES = calibrate.DeviceRates(matmul_flops=5e10, mem_bandwidth=2e10, attention_flops=2e10,
                              per_op_overhead=5e-6, matmul_half=16.0)


@pytest.fixture(autouse=True)
def fixed_rates(monkeypatch):
    monkeypatch.setattr(calibrate, "load_or_measure", lambda *a, **k: RATES)


def linear_stage(per_token: float, fixed: float, text: float = 0.0):
    """Seconds of a chunk: fixed, per image token, and `text` for the whole text segments."""
    return lambda n, c, share=1.0: fixed + per_token * n + text * share


def test_step_time_is_terapipe_objective():
    assert step_time([3.0, 1.0], stages=3) == 4.0 + 2 * 3.0


def test_stale_trades_overhead_against_fill():
    # Big fixed cost per chunk: as few chunks as stages; none: as many as units.
    assert len(choose_stale(16, 256, [linear_stage(1e-6, 1.0)] * 2)) == 2
    assert len(choose_stale(16, 256, [linear_stage(1e-6, 0.0)] * 2)) == 16


def test_ring_needs_fewer_chunks_than_one_call():
    """A call pays the fill every step, a ring once: with a per-chunk overhead the ring
    settles on fewer chunks, never fewer than the stages (the ring would stall)."""
    stages = [linear_stage(1e-6, 2e-5)] * 2
    per_call = len(choose_stale(16, 1024, stages))
    ring = len(choose_stale(16, 1024, stages, ring_steps=19))
    assert 2 <= ring < per_call
    assert len(choose_stale(16, 1024, [linear_stage(1e-6, 0.0)] * 2, ring_steps=19)) >= 2


def test_a_first_chunk_with_the_text_gets_fewer_image_rows():
    """Text worth 32 of 128 rows, 2 chunks: the first takes 48 rows and the text (80 rows'
    time), the second 80 rows; the even table's first chunk would take 96 rows' time."""
    stage = linear_stage(1e-3, 0.0, text=32e-3)
    assert [c.units for c in lighter_first(128, 2, 128, [stage] * 2)] == [48, 80]
    assert [c.units for c in lighter_first(128, 4, 128, [stage] * 2)] == [8, 40, 40, 40]
    # A text heavier than a chunk leaves the first chunk one row.
    heavy = linear_stage(1e-3, 0.0, text=1.0)
    assert [c.units for c in lighter_first(16, 2, 16, [heavy] * 2)] == [1, 15]


def test_auto_stale_evens_out_the_first_chunk_that_computes_the_text():
    """A ring of 2 stages and 2 chunks waits on a first chunk that also computes the text;
    a lighter first chunk removes the wait. Without text computed once, tables stay even
    and every chunk computes the text."""
    stages = [linear_stage(1e-3, 1e-2, text=32e-3)] * 2
    table = choose_stale(128, 128, stages, ring_steps=19, text_once=True)
    sizes = [c.units for c in table]
    assert [c.segments for c in table] == [True] + [False] * (len(table) - 1)
    assert sizes[0] < sizes[1], sizes
    even = choose_stale(128, 128, stages, ring_steps=19)
    assert all(c.segments for c in even)
    assert len({c.units for c in even[:-1]}) == 1


def test_causal_chunks_shrink_with_context():
    def attention_heavy(n, c):
        return 1e-3 + 1e-6 * n * c

    table = choose_causal(64, 64, [attention_heavy] * 2)
    sizes = [c.units for c in table]
    assert sum(sizes) == 64 and len(sizes) > 1
    assert sizes[0] > sizes[-1]
    assert sizes == sorted(sizes, reverse=True)


def test_auto_stale_picks_a_count_and_logs(caplog):
    model, traced = traced_dit(2, 32, 2, 16)  # 8 token rows
    with caplog.at_level(logging.INFO, logger="tokpipe_compiler"):
        program = traced.program(mode="stale", stages=2, chunks="auto", warmup_steps=3)
    assert 2 <= len(program.plan.chunks) <= 8
    assert "chunks='auto' (stale)" in caplog.text
    latents, t, labels = dit_inputs(model, 16)
    (out,) = program(*traced.args(latents=latents, timestep=t, labels=labels))
    assert_rel_close(out, eager(model, latents, t, labels))


def test_auto_causal_is_non_uniform_and_exact():
    model, traced = traced_causal(2, 32, 2, 256)
    program = traced.program(mode="causal", stages=2, chunks="auto")
    sizes = [c.units for c in program.plan.chunks]
    assert len(set(sizes)) > 1 and sizes[0] > sizes[-1], sizes
    x = torch.randn(1, 256, 32, generator=torch.Generator().manual_seed(3))
    (out,) = program(*traced.args(x=x))
    with torch.no_grad():
        assert_rel_close(out, model(x))


def test_auto_stale_gives_the_chunk_that_computes_the_text_fewer_rows():
    """Joint attention with the text computed by each step's first chunk: chunks="auto"
    gives that chunk fewer image rows than the others, and the plan stays exact on a
    repeated input. With text_chunks="every" the table stays even."""
    from tests.compiler.test_joint import TinyJoint, inputs
    from tests.fixtures.tracing import trace

    torch.manual_seed(0)
    model = TinyJoint().eval()
    x, text = inputs(0, length=48)
    traced = trace(model, x, text)
    program = traced.program(mode="stale", stages=2, chunks="auto", warmup_steps=1)
    table = program.plan.chunks
    assert [c.segments for c in table] == [True] + [False] * (len(table) - 1)
    assert table[0].units < table[1].units, [c.units for c in table]
    for _ in range(2):
        (out,) = program(*traced.args(x=x, text=text))
    with torch.no_grad():
        assert_rel_close(out, model(x, text))
    every = traced.program(mode="stale", stages=2, chunks="auto", text_chunks="every")
    sizes = [c.units for c in every.plan.chunks]
    assert len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0], sizes
