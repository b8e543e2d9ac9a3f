"""diffusers models on two gloo ranks: every rank returns what one process computes.

Joint text+image attention (Flux, SD3, AuraFlow) sends the whole text segment with every
chunk across the stage boundary; a receive sized for the image tokens alone would abort.
Every selected case runs in one launch (tests/fixtures/ranks.py: starting ranks costs more
than a case).
"""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.ranks import launch_cases, selected
from tests.fixtures.zoo import ZOO, build

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

JOINT = ["FluxTransformer2DModel", "SD3Transformer2DModel", "AuraFlowTransformer2DModel"]


def _both_ways(rank: int, world: int, name: str, mode: str) -> list[tuple[torch.Tensor, ...]]:
    """(pipelined on the ranks, the same options in this one process, eager) per call."""
    model = build(name)
    options = {"stages": world, "chunks": ZOO[name].chunks, "mode": mode, "compiler": "eager",
               "warmup_steps": 1, "timeout": 60.0}
    spread = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    results = []
    for seed in (0, 0, 1):  # warmup, stale on a repeated input, stale on a new one
        inputs = ZOO[name].inputs(seed)
        with torch.no_grad():
            got = spread(**inputs).sample
            expected = model(**inputs).sample
        results.append((got, expected))
    local = tp.programs(spread)[0].plan
    return [*results, (torch.tensor(len(local.stages)),)]


@pytest.fixture(scope="module")
def joint_runs(request) -> dict:
    """Per-rank results of every selected (name, mode), from one launch."""
    cases = {(p["name"], p["mode"]): (_both_ways, (p["name"], p["mode"]))
             for p in selected(request, test_joint_attention_on_two_ranks)}
    return launch_cases(cases, 2, timeout=300 * len(cases))


@pytest.mark.parametrize("name", JOINT)
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_joint_attention_on_two_ranks(name, mode, joint_runs):
    per_rank = joint_runs[name, mode]
    for results in per_rank:
        *calls, (stages,) = results
        assert stages.item() == 2
        for call, (got, expected) in enumerate(calls):
            exact = mode == "sync" or call < 2  # stale: warmup, then a repeated input
            if exact:
                scale = expected.abs().max().item()
                assert (got - expected).abs().max().item() <= 1e-5 * scale, (name, mode, call)
    # every rank returns the same tensor
    for a, b in zip(per_rank[0][:-1], per_rank[1][:-1], strict=True):
        assert torch.equal(a[0], b[0])
