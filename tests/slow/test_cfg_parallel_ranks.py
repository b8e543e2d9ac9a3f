"""parallelize(pipe, cfg=2) on gloo ranks: each guidance branch on its own rank (two ranks,
one launch for them all, tests/fixtures/ranks.py), or its own ring (cfg=2 x stages=2 on
four). Every rank returns what one process computes (within 1e-5 relative, float32), or
every rank raises."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate
from tests.fixtures.ranks import launch_cases, selected
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
pytest.importorskip("transformers")

FAMILIES = {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED}


def _cfg(family: str) -> torch.Tensor:
    pipe, kwargs = FAMILIES[family]()
    tp.pipelines.parallelize(pipe, cfg=2, stages=1, compiler="eager")
    return generate(pipe, kwargs, steps=4)


def _cfg_rank(rank: int, world: int, family: str) -> torch.Tensor:
    return _cfg(family)


@pytest.mark.parametrize("family", ["dit", pytest.param("wan", marks=pytest.mark.full)])
def test_cfg_parallel_on_two_ranks_equals_one_process(family, two_rank_runs):
    """cfg=2: rank 0 runs the conditional branch, rank 1 the unconditional one (DiT: the
    halves of one batch; Wan: its two calls), one all-gather per step."""
    alone = _cfg(family)
    for result in two_rank_runs["cfg", family]:
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


def _cfg_unguided(rank: int, world: int) -> tuple[torch.Tensor, list[str]]:
    pipe, kwargs = FAMILIES["dit"]()
    tp.pipelines.parallelize(pipe, cfg=2, stages=1, compiler="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latents = generate(pipe, {**kwargs, "guidance_scale": 1.0}, steps=3)
    return latents, [str(w.message) for w in caught]


def test_cfg_parallel_runs_an_unguided_call_whole_on_each_rank(two_rank_runs):
    """A call with one branch has nothing to split: each rank runs the whole transformer,
    says so, and returns the serial pipeline's latents."""
    pipe, kwargs = FAMILIES["dit"]()
    serial = generate(pipe, {**kwargs, "guidance_scale": 1.0}, steps=3)
    for latents, messages in two_rank_runs["cfg unguided"]:
        assert (latents - serial).abs().max().item() <= 1e-5 * serial.abs().max().item()
        assert any("no classifier-free guidance" in m and "unparallelized" in m
                   for m in messages)


def _cfg_seeds_differ(rank: int, world: int) -> str:
    pipe, kwargs = FAMILIES["dit"]()
    tp.pipelines.parallelize(pipe, cfg=2, stages=1, compiler="eager")
    try:
        generate(pipe, kwargs, steps=2, seed=rank)
    except tp.TokpipeError as err:
        return str(err)
    return ""


def test_cfg_parallel_ranks_whose_calls_differ_raise(two_rank_runs):
    """Each rank's branch swaps predictions with the other's: calls of other seeds would
    mix two generations into two wrong images, silently."""
    for message in two_rank_runs["cfg seeds differ"]:
        assert "cfg=2: the ranks' calls start different generations" in message


HYBRID = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def _hybrid(family: str, cfg: int) -> torch.Tensor:
    pipe, kwargs = FAMILIES[family]()
    tp.pipelines.parallelize(pipe, cfg=cfg, **HYBRID)
    return generate(pipe, kwargs, steps=4)


def _hybrid_rank(rank: int, world: int, family: str) -> tuple[torch.Tensor, str]:
    pipe, kwargs = FAMILIES[family]()
    tp.pipelines.parallelize(pipe, cfg=2, **HYBRID)
    latents = generate(pipe, kwargs, steps=4)
    try:  # then the branches' ranks start generations of different seeds
        generate(pipe, kwargs, steps=2, seed=rank // 2)
    except tp.TokpipeError as err:
        return latents, str(err)
    return latents, ""


@pytest.mark.parametrize("family", ["dit", pytest.param("wan", marks=pytest.mark.full)])
def test_hybrid_cfg_on_four_ranks_equals_one_process(family):
    """cfg=2 x stages=2: ranks 0-1 run the conditional branch's ring, ranks 2-3 the
    unconditional one's, and the last stages swap each chunk's prediction. Every rank
    returns what one process computes with both branches batched in one ring (stale K/V
    of the same freshness: each branch keeps its own). Calls whose branches start
    different generations raise on every rank, as with one stage per branch."""
    alone = _hybrid(family, cfg=1)
    for result, message in launch(_hybrid_rank, 4, args=(family,), timeout=900):
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
        assert "cfg=2: the ranks' calls start different generations" in message


@pytest.fixture(scope="module")
def two_rank_runs(request) -> dict:
    """Per-rank results of the selected two-rank runs, from one launch."""
    cases = {("cfg", p["family"]): (_cfg_rank, (p["family"],))
             for p in selected(request, test_cfg_parallel_on_two_ranks_equals_one_process)}
    if selected(request, test_cfg_parallel_ranks_whose_calls_differ_raise):
        cases["cfg seeds differ"] = (_cfg_seeds_differ, ())
    if selected(request, test_cfg_parallel_runs_an_unguided_call_whole_on_each_rank):
        cases["cfg unguided"] = (_cfg_unguided, ())
    if selected(request, test_cfg_parallel_checks_the_world_size):
        cases["wrong world"] = (_wrong_world, ())
    return launch_cases(cases, 2, timeout=600 * len(cases))


def _wrong_world(rank: int, world: int) -> str:
    try:
        tp.pipelines.parallelize(FAMILIES["dit"]()[0], cfg=1, stages=1)
    except tp.TokpipeError as err:
        return str(err)
    return ""


def test_cfg_parallel_checks_the_world_size(two_rank_runs):
    for message in two_rank_runs["wrong world"]:
        assert "cfg=1 x stages=1 needs 1 rank(s); the process group has 2" in message
