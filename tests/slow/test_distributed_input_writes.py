"""Buffers updated in place in forward, on two gloo ranks: each rank holds its own copy of
the model, and every copy is updated once per call, as eager updates it in each process,
while the outputs equal eager's. The selected cases share one launch
(tests/fixtures/ranks.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import UpdatesBuffers, dit_inputs
from tests.fixtures.ranks import launch_cases, selected

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

SEEDS = (0, 0, 1)  # stale: warmup, a repeated input (exact), a new one


def _updates(rank: int, world: int, mode: str) -> tuple[list, list, list]:
    """([(pipelined, eager)] per call, this rank's buffers, eager's buffers)."""
    torch.manual_seed(0)
    model = UpdatesBuffers().eval()
    reference = copy.deepcopy(model)
    options = {"stages": world, "chunks": 2, "mode": mode, "compiler": "eager",
               "warmup_steps": 1, "timeout": 60.0}
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    outputs = []
    for seed in SEEDS:
        inputs = dit_inputs(model, 8, seed=seed)
        with torch.no_grad():
            outputs.append((compiled(*inputs), reference(*inputs)))
    return outputs, list(model.buffers()), list(reference.buffers())


@pytest.fixture(scope="module")
def runs(request) -> dict:
    """Per-rank results of every selected mode, from one launch."""
    cases = {p["mode"]: (_updates, (p["mode"],))
             for p in selected(request, test_every_rank_updates_its_copy_of_the_buffers)}
    return launch_cases(cases, 2, timeout=240 * len(cases))


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_every_rank_updates_its_copy_of_the_buffers(mode, runs):
    for outputs, buffers, expected in runs[mode]:
        for call, (got, eager) in enumerate(outputs):
            if mode == "sync" or call < 2:
                scale = eager.abs().max().item()
                assert (got - eager).abs().max().item() <= 1e-5 * scale, (mode, call)
        for got, eager in zip(buffers, expected, strict=True):
            assert torch.equal(got, eager), (mode, got, eager)
