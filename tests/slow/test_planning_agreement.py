"""Ranks plan alike: with rates that would choose other chunk tables on each rank
(chunks="auto"), every rank plans with rank 0's, through the backend and through a Ring,
and the pipeline runs (ranks that planned apart would stop at the first call's
fingerprint check)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

GRID = 16  # 8 token rows
# Launches free (many chunks) against launches dear (as few chunks as stages).
RATES = [calibrate.DeviceRates(matmul_flops=5e10, mem_bandwidth=2e10, attention_flops=2e10,
                               per_op_overhead=overhead)
         for overhead in (1e-9, 1e-2)]
OPTIONS = {"stages": 2, "chunks": "auto", "mode": "stale", "warmup_steps": 1,
           "compiler": "eager", "timeout": 60.0}


def _model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(depth=3, width=32, heads=2, grid=GRID).eval()


def _table_at(rates: calibrate.DeviceRates) -> list[int]:
    model = _model()
    with calibrate.assume_rates("cpu", rates):
        plan = tp.explain(model, dit_inputs(model, GRID), **OPTIONS)
    return [c.units for c in plan.chunks]


def _rank(rank: int, world: int) -> dict:
    """Plans from this rank's own rates cache (rank r's: RATES[r])."""
    os.environ[calibrate.CACHE_ENV] = tempfile.mkdtemp()
    calibrate.save_rates(RATES[rank])
    model = _model()
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS), dynamic=False)
    latents, t, labels = dit_inputs(model, GRID)
    with torch.no_grad():
        outs = [compiled(latents, t, labels) for _ in range(2)]
    (program,) = tp.programs(compiled)

    def step(latents, timestep, labels):
        return latents - 0.1 * model(latents, timestep[None], labels)[:, :4]

    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    (ringed,) = ring.run({"latents": latents, "labels": labels},
                         per_step={"timestep": torch.tensor([900, 600, 300])})
    return {"call": [c.units for c in program.plan.chunks], "outs": outs,
            "ring": [c.units for c in ring.program.plan.chunks], "ringed": ringed}


def test_every_rank_plans_with_rank_zero_rates():
    zero, one = (_table_at(rates) for rates in RATES)
    assert zero != one  # each rank's own rates would choose another table
    first, second = launch(_rank, 2, timeout=300)
    assert first["call"] == second["call"] == zero
    assert first["ring"] == second["ring"]
    for a, b in zip(first["outs"], second["outs"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first["ringed"], second["ringed"])
