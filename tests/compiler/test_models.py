"""diffusers transformers from small configs with random weights, in every mode that applies.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.fixtures.tracing import Traced, assert_rel_close, rel_error, trace
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.runtime.executor import boundary_names

pytest.importorskip("diffusers")

NAMED = ["DiTTransformer2DModel", "PixArtTransformer2DModel", "SD3Transformer2DModel",
         "FluxTransformer2DModel", "HunyuanDiT2DModel", "CogVideoXTransformer3DModel"]


@functools.cache
def traced(name: str) -> tuple[torch.nn.Module, Traced]:
    model = build(name)
    return model, trace(model, **ZOO[name].inputs(0))


def run(name: str, program, seed: int | dict) -> torch.Tensor:
    _, t = traced(name)
    inputs = ZOO[name].inputs(seed) if isinstance(seed, int) else seed
    # Inputs the graph does not read (sizes, lists Dynamo made constants) are left out.
    return program(*t.with_arguments(inputs, strict=False))[0]


def eager(name: str, seed: int | dict) -> torch.Tensor:
    model, _ = traced(name)
    with torch.no_grad():
        return model(**(ZOO[name].inputs(seed) if isinstance(seed, int) else seed))[0]


def program(name: str, **options):
    options.setdefault("chunks", ZOO[name].chunks)
    return traced(name)[1].program(**options)


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("stages", [1, 2])
def test_sync_equals_eager(name, stages):
    p = program(name, mode="sync", stages=stages)
    for seed in (1, 2):
        assert_rel_close(run(name, p, seed), eager(name, seed))


@pytest.mark.parametrize("name", NAMED)
def test_stale_with_warmup_on_every_call_equals_eager(name):
    p = program(name, mode="stale", stages=2, warmup_steps=3)
    for seed in (1, 2, 3):
        assert_rel_close(run(name, p, seed), eager(name, seed))


@pytest.mark.parametrize("name", NAMED)
def test_stale_on_repeated_input_equals_eager(name):
    p = program(name, mode="stale", stages=2, warmup_steps=1)
    run(name, p, 4)
    assert_rel_close(run(name, p, 4), eager(name, 4))


@pytest.mark.parametrize("name", NAMED)
def test_stale_on_changing_input_is_stale(name):
    p = program(name, mode="stale", stages=2, warmup_steps=1)
    first, second = ZOO[name].inputs(5), ZOO[name].inputs(6)
    second["timestep"] = first["timestep"] * 0.5  # the next step: a lower timestep
    run(name, p, first)
    assert rel_error(run(name, p, second), eager(name, second)) > 1e-4


@pytest.mark.parametrize("name", ["SD3Transformer2DModel", "FluxTransformer2DModel",
                                  "CogVideoXTransformer3DModel"])
def test_joint_attention_keeps_text_whole_in_every_chunk(name):
    """The text tokens ride with every chunk: attention inputs carry a whole text segment."""
    from tokpipe_compiler.core.meta import ATTENTION, META_KEY

    plan = program(name, mode="stale", stages=2).plan
    infos = [n.meta[META_KEY] for g in plan.graphs.stages for n in g.gm.graph.nodes
             if META_KEY in n.meta and n.meta[META_KEY].kind == ATTENTION]
    assert infos and all(i.lead + i.trail == 5 for i in infos)


def test_video_chunks_are_frame_ranges():
    """CogVideoX: the token grid is frames x height x width; a unit is one latent frame."""
    plan = program("CogVideoXTransformer3DModel", mode="stale", stages=2, chunks=4).plan
    assert plan.units == 4 and [c.units for c in plan.chunks] == [1, 1, 1, 1]


def test_hunyuan_long_skips_go_only_to_their_consumer():
    """Long skips (block i -> block depth-1-i) cross stages: each is sent to the stage that
    reads it and to no other."""
    plan = program("HunyuanDiT2DModel", mode="stale", stages=4).plan
    stages = plan.graphs.stages
    skips = {(s, c) for s, consumers in plan.consumers.items() for c in consumers if c > s + 1}
    assert skips, plan.consumers
    for producer, consumer in skips:
        assert boundary_names(stages, producer, consumer)
    for producer in range(len(stages)):
        for consumer in range(len(stages)):
            if consumer not in plan.consumers[producer]:
                assert not boundary_names(stages, producer, consumer)
    p = program("HunyuanDiT2DModel", mode="sync", stages=4)
    assert_rel_close(run("HunyuanDiT2DModel", p, 1), eager("HunyuanDiT2DModel", 1))




@pytest.mark.slow
@pytest.mark.parametrize("name", ["DiTTransformer2DModel", "SD3Transformer2DModel",
                                  "FluxTransformer2DModel"])
def test_inductor_stages_equal_eager_stages(name):
    options = {"mode": "stale", "stages": 2, "chunks": 2, "warmup_steps": 0}
    compiled = program(name, compiler="inductor", **options)
    reference = program(name, **options)
    for seed in (1, 2):
        assert_rel_close(run(name, compiled, seed), run(name, reference, seed))
