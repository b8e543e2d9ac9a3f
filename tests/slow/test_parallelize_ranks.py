"""parallelize(pipe) on two gloo ranks: each rank calls the pipeline as written, the loop
runs as one ring across them, and every rank returns what one process computes (within
1e-5 relative, float32)."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import FAMILIES, generate
from tokpipe_compiler.runtime.launch import launch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

OPTIONS = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def _pipelined(family: str) -> torch.Tensor:
    pipe, kwargs = FAMILIES[family]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    return generate(pipe, kwargs, steps=4)


def _rank(rank: int, world: int, family: str) -> torch.Tensor:
    return _pipelined(family)


@pytest.mark.parametrize("family", [
    pytest.param("pixart_alpha", marks=pytest.mark.full),  # one batched call, DPM-Solver++
    "wan",  # two calls per step, UniPC (three carried states)
    pytest.param("flux", marks=pytest.mark.full),  # joint attention, dynamic shift
    pytest.param("ltx", marks=pytest.mark.full),
])
def test_two_ranks_equal_one_process(family):
    alone = _pipelined(family)
    ranks = launch(_rank, 2, args=(family,), timeout=600)
    for result in ranks:
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
