"""parallelize(pipe, cfg=2) in one process: each guidance branch alone (stages=1, the
branches in turn), or both batched in one ring (stages > 1), equal to the serial
pipeline within 1e-5 of the output's largest value (float32); a call the branches cannot
split runs whole, with a warning. On ranks: tests/slow/test_cfg_parallel_ranks.py."""

from __future__ import annotations

import warnings

import pytest

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.more_pipelines import MORE
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate
from tests.fixtures.tracing import rel_error
from tests.fixtures.video_pipelines import VIDEO

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

FAMILIES = {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED, **MORE, **VIDEO,
            **pipelines.NOISY}


@pytest.mark.parametrize("family", ["dit", "wan", "wan22", "flux_inpaint", "flux_ip_adapter",
                                    "kandinsky5_video", "pixart_ancestral"])
def test_cfg_parallel_in_one_process_equals_serial(family):
    """cfg=2, stages=1: each guidance branch runs alone (one batch half, or one of the two
    calls), then guidance and the update combine them; in one process the branches run in
    turn. Kandinsky 5 writes its latents in place (the branches start from a copy) and
    passes rotary positions of 2 rows for its 2 latent frames, which no branch halves.
    Euler ancestral adds the noise each step draws, as the pipeline's step drew it."""
    make = FAMILIES[family]
    serial = generate(*make())
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, cfg=2, stages=1, compiler="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: cfg=2")  # branches apart
        assert rel_error(generate(pipe, kwargs), serial) <= 1e-5
    with pytest.raises(tp.TokpipeError, match="each guidance branch whole"):
        tp.pipelines.programs(pipe)


@pytest.mark.parametrize("family", ["dit", "kandinsky5_video", "pixart_ancestral",
                                    pytest.param("wan22", marks=pytest.mark.full)])
def test_hybrid_cfg_in_one_process_equals_serial(family):
    """cfg=2 x stages=2 without a process group: both branches batched in one ring, the
    generation the four ranks compute (tests/slow/test_parallelize_ranks.py)."""
    make = FAMILIES[family]
    serial = generate(*make())
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, cfg=2, stages=2, chunks=2, mode="sync", compiler="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: cfg=2")  # branches apart
        assert rel_error(generate(pipe, kwargs), serial) <= 1e-5


def test_cfg_parallel_checks_its_degrees():
    with pytest.raises(tp.TokpipeError, match="two branches"):
        tp.pipelines.parallelize(FAMILIES["dit"]()[0], cfg=3, stages=1)
    with pytest.raises(tp.TokpipeError, match="ring=False"):
        tp.pipelines.parallelize(FAMILIES["dit"]()[0], cfg=2, stages=1, ring=False)


@pytest.mark.parametrize(("make", "why"), [
    (lambda: FAMILIES["flux"](true_cfg=False), "no classifier-free guidance"),
    (PERTURBED["pixart_sigma_pag"], "perturbed-attention guidance"),
    (pipelines.with_scheduler(FAMILIES["dit"], "DDPMScheduler", clip_sample=True),
     "DDPMScheduler option clip_sample=True"),
], ids=["unguided", "perturbed", "clamping-scheduler"])
@pytest.mark.parametrize("stages", [1, 2])
def test_a_call_cfg_parallelism_cannot_split_runs_whole_with_a_warning(make, why, stages):
    """A server's cfg=2 pipeline gets calls it cannot split into guidance branches: one
    without guidance, one with perturbed-attention guidance (its processors split the batch
    inside the transformer), one whose scheduler clamps its x0. Each runs the whole
    transformer per call (on every rank) and says so; it equals the serial pipeline, and
    the next guided call runs as the ring again."""
    serial = generate(*make(), steps=3)
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, cfg=2, stages=stages, chunks=2, mode="sync",
                             compiler="eager")
    with pytest.warns(UserWarning, match=f"cfg=2: .*cannot run this call's guidance branches "
                                         f"apart \\(.*{why}.*unparallelized"):
        whole = generate(pipe, kwargs, steps=3)
    assert rel_error(whole, serial) <= 1e-5


def test_a_guided_call_after_an_unguided_one_runs_the_ring():
    make = FAMILIES["dit"]
    serial = generate(*make(), steps=3)
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, cfg=2, stages=1, compiler="eager")
    with pytest.warns(UserWarning, match="no classifier-free guidance"):
        generate(pipe, {**kwargs, "guidance_scale": 1.0}, steps=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: cfg=2")
        assert rel_error(generate(pipe, kwargs, steps=3), serial) <= 1e-5
