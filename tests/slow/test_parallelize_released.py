"""parallelize(pipe) as users run it: released-width transformers (one block, a small grid)
inside their diffusers pipelines, with the released text lengths, guided (batch 2 or two
calls), 3 steps. Sync equals serial, and on two gloo ranks the stale ring returns what one
process computes (within 1e-5 relative, float32); so does the hybrid cfg=2 x stages=2 on
four."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import generate
from tests.fixtures.released_pipelines import RELEASED, released_sd3_modular
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
pytest.importorskip("transformers")

OPTIONS = {"stages": 2, "chunks": 2, "warmup_steps": 1, "compiler": "eager"}
STEPS = 3  # the warmup step, then two stale steps: the ring runs them


def _ring(name: str, mode: str | None) -> torch.Tensor:
    """The pipeline's latents: serial (mode None), or parallelized in `mode`."""
    pipe, kwargs = RELEASED[name]()
    if mode is not None:
        tp.pipelines.parallelize(pipe, mode=mode, **OPTIONS)
    out = generate(pipe, kwargs, steps=STEPS)
    # diffusers' pipelines are reference cycles: free this one's weights before the next
    # is built (Wan 2.2 A14B's experts at 14B widths are 4.4 GiB) and the ranks start
    del pipe, kwargs
    gc.collect()
    return out


def _rank(rank: int, world: int, name: str) -> torch.Tensor:
    return _ring(name, "stale")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


@pytest.mark.parametrize("name", [
    "pixart-alpha",
    pytest.param("wan2.1-1.3b", marks=pytest.mark.full),
    "sd3-medium",  # joint text+image attention, inside its pipeline on two ranks
    pytest.param("sana-1600m", marks=pytest.mark.full),
    "flux-kontext",  # the image's tokens carried in the ring's sample, two calls per step
    pytest.param("flux-inpaint", marks=pytest.mark.full),  # latents blended between steps
    pytest.param("wan2.2-a14b", marks=pytest.mark.full),  # two experts, a ring each
])
def test_released_widths_in_their_pipeline_on_two_ranks(name):
    serial = _ring(name, None)
    assert _relative(_ring(name, "sync"), serial) <= 1e-5
    alone = _ring(name, "stale")
    assert not torch.equal(alone, serial)  # stale K/V after the warmup step
    for result in launch(_rank, 2, args=(name,), timeout=900):
        assert _relative(result, alone) <= 1e-5


def _modular(mode: str | None) -> torch.Tensor:
    """SD3-medium's widths in the modular SD3 pipeline: serial (mode None) or parallelized."""
    pipe, call = released_sd3_modular()
    if mode is not None:
        tp.pipelines.parallelize(pipe, mode=mode, **OPTIONS)
    return call(pipe, STEPS)


def _modular_rank(rank: int, world: int) -> torch.Tensor:
    return _modular("stale")


def test_a_released_width_modular_pipeline_on_two_ranks():
    """diffusers' modular SD3 pipeline (its loop built from blocks, the guidance its
    guider's) at SD3-medium's widths with 333 text tokens runs as a ring: sync equals
    serial, and two gloo ranks return what one process computes in stale mode."""
    serial = _modular(None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        assert _relative(_modular("sync"), serial) <= 1e-5
        alone = _modular("stale")
    assert not torch.equal(alone, serial)
    for result in launch(_modular_rank, 2, timeout=900):
        assert _relative(result, alone) <= 1e-5


def _hybrid(name: str, cfg: int) -> torch.Tensor:
    pipe, kwargs = RELEASED[name]()
    tp.pipelines.parallelize(pipe, mode="stale", cfg=cfg, **OPTIONS)
    return generate(pipe, kwargs, steps=STEPS)


def _hybrid_rank(rank: int, world: int, name: str) -> torch.Tensor:
    return _hybrid(name, cfg=2)


@pytest.mark.full
def test_released_widths_hybrid_cfg_on_four_ranks():
    """cfg=2 x stages=2 at released widths (PixArt-alpha 1024-MS, T5 120 x 4096): each
    guidance branch's ring on two ranks, equal to one process with the branches batched."""
    alone = _hybrid("pixart-alpha", cfg=1)
    for result in launch(_hybrid_rank, 4, args=("pixart-alpha",), timeout=1200):
        assert _relative(result, alone) <= 1e-5


def _auto_rank(rank: int, world: int, name: str) -> tuple[torch.Tensor, list]:
    from tokpipe_compiler.pipelines.marks import programs

    pipe, kwargs = RELEASED[name]()
    tp.pipelines.parallelize(pipe, **{**OPTIONS, "chunks": "auto"}, mode="stale")
    out = generate(pipe, kwargs, steps=STEPS)
    return out, [[(c.units, c.segments) for c in p.plan.chunks] for p in programs(pipe)]


@pytest.mark.full
def test_released_joint_attention_with_auto_chunks_on_two_ranks():
    """chunks="auto" at SD3-medium's widths (333 text tokens, batched guidance): both ranks
    plan one table, whose first chunk alone computes the text, and return the same latents."""
    (first, first_tables), (second, second_tables) = launch(
        _auto_rank, 2, args=("sd3-medium",), timeout=900)
    assert first_tables == second_tables
    for table in first_tables:
        assert [has for _, has in table] == [True] + [False] * (len(table) - 1)
    assert torch.equal(first, second)
