"""One process per stage over gloo: the same numbers as the in-process runtime, bit for bit,
and a clear error, never a hang, when a rank dies. The two-rank runs that succeed share one
launch (tests/fixtures/ranks.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.ranks import launch_cases, selected
from tests.fixtures.tracing import trace
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def _per_call(rank: int, world: int, options: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyDiT(depth=3, width=32, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    reference = traced.program(**options)  # in-process, in this same process
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    results = []
    for seed in range(3):
        latents, t, labels = dit_inputs(model, 8, seed=seed)
        with torch.no_grad():
            got = compiled(latents, t, labels)
        (expected,) = reference(*traced.args(latents=latents, timestep=t, labels=labels))
        results.append((got, expected))
    return results


def _options(world: int, mode: str, chunks: int) -> dict:
    return {"stages": world, "chunks": chunks, "mode": mode, "warmup_steps": 1,
            "compiler": "eager", "timeout": 60.0}


SHARE = {"stages": 2, "chunks": 2, "mode": "stale", "compiler": "eager", "timeout": 60.0}


@pytest.fixture(scope="module")
def two_rank_runs(request) -> dict:
    """Per-rank results of the selected two-rank runs that succeed, from one launch."""
    cases = {(p["world"], p["mode"], p["chunks"]): (_per_call, (_options(**p),))
             for p in selected(request, test_ranks_equal_in_process_bit_for_bit)
             if p["world"] == 2}
    if selected(request, test_each_rank_holds_its_share_of_the_weights):
        cases["share"] = (_param_share, (SHARE,))
    return launch_cases(cases, 2, timeout=240 * len(cases))


@pytest.mark.parametrize(("world", "mode", "chunks"), [(2, "stale", 2), (3, "stale", 4),
                                                        (2, "sync", 1)])
def test_ranks_equal_in_process_bit_for_bit(world, mode, chunks, request):
    if world == 2:
        per_rank = request.getfixturevalue("two_rank_runs")[world, mode, chunks]
    else:
        options = _options(world, mode, chunks)
        per_rank = launch(_per_call, world, args=(options,), timeout=240)
    for rank_results in per_rank:
        for got, expected in rank_results:
            assert torch.equal(got, expected)


def _dies(rank: int, world: int, options: dict) -> None:
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        compiled(*inputs)  # warmup call: every rank alive
        if rank == 0:
            os._exit(3)
        compiled(*inputs)


def test_killed_rank_makes_the_others_raise_in_time():
    options = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager", "timeout": 5.0}
    start = time.monotonic()
    with pytest.raises(tp.TokpipeError) as err:
        launch(_dies, 2, args=(options,), timeout=120)
    assert time.monotonic() - start < 90
    text = str(err.value)
    assert "rank 1" in text and "rank 0" in text
    assert "chunk" in text and "step" in text


def _param_share(rank: int, world: int, options: dict) -> tuple[int, int]:
    torch.manual_seed(0)
    model = TinyDiT(depth=4, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    with torch.no_grad():
        compiled(*dit_inputs(model, 8))
    (program,) = tp.programs(compiled)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return program.param_bytes, total


def test_each_rank_holds_its_share_of_the_weights(two_rank_runs):
    for held, total in two_rank_runs["share"]:
        assert abs(held - total / 2) <= 0.1 * total / 2, (held, total)
