"""chunks="auto": chosen tables from predicted stage times, and exactness with them."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.compiler.test_semantics import dit_inputs, eager, traced_causal, traced_dit
from tests.fixtures.tracing import assert_rel_close
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.costmodel.chunk_choice import choose_causal, choose_stale, step_time

# Fixed rates of a modest CPU: tests never measure the machine they run on.
RATES = calibrate.DeviceRates(matmul_flops=5e10, mem_bandwidth=2e10, attention_flops=2e10,
                              per_op_overhead=5e-6, matmul_half=16.0)


@pytest.fixture(autouse=True)
def fixed_rates(monkeypatch):
    monkeypatch.setattr(calibrate, "load_or_measure", lambda *a, **k: RATES)


def linear_stage(per_token: float, fixed: float):
    return lambda n, c: fixed + per_token * n


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
