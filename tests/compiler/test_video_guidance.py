"""Guided video at batch 2 (classifier-free guidance doubles the batch): Latte and CogVideoX
merge the batch with the frames (`[B, F, C, H, W] -> [B * F, C, H, W]`), so the token axis
(frames) is the inner factor of a merged axis whose outer blocks are the batch rows.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.fixtures.tracing import Traced, assert_rel_close, rel_error, trace
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.core.meta import META_KEY

pytest.importorskip("diffusers")

VIDEO = ["LatteTransformer3DModel", "CogVideoXTransformer3DModel"]


def guided_inputs(name: str, seed: int) -> dict[str, Any]:
    """Batch 2: the conditional and unconditional branch (each tensor input of batch 1 from
    two seeds), one timestep for both."""
    cond, uncond = ZOO[name].inputs(seed), ZOO[name].inputs(seed + 1000)
    out = dict(cond)
    for key, value in cond.items():
        if key == "timestep":
            out[key] = torch.cat([value, value])
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1:
            out[key] = torch.cat([value, uncond[key]])
    return out


@functools.cache
def traced(name: str) -> tuple[torch.nn.Module, Traced]:
    model = build(name)
    return model, trace(model, **guided_inputs(name, 0))


def run(name: str, program, inputs: dict[str, Any]) -> torch.Tensor:
    return program(*traced(name)[1].with_arguments(inputs, strict=False))[0]


def eager(name: str, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return traced(name)[0](**inputs)[0]


def program(name: str, **options):
    options.setdefault("chunks", ZOO[name].chunks)
    return traced(name)[1].program(**options)


@pytest.mark.parametrize("name", VIDEO)
def test_batch_merged_with_frames_is_recorded_as_outer_blocks(name):
    plan = program(name, mode="stale", stages=2).plan
    outers = {n.meta[META_KEY].outer for g in plan.graphs.stages for n in g.gm.graph.nodes
              if META_KEY in n.meta and n.meta[META_KEY].carries_tokens}
    assert outers == {1, 2}



def test_latte_sends_a_value_of_two_blocks_between_stages():
    """Latte's residual stream is [B * F, H * W, D]: the boundary value has outer 2."""
    plan = program("LatteTransformer3DModel", mode="stale", stages=2).plan
    sent = [info.outer for g in plan.graphs.stages for info in g.output_infos.values()]
    assert 2 in sent


@pytest.mark.parametrize("name", VIDEO)
@pytest.mark.parametrize("stages", [1, 2])
def test_sync_equals_eager(name, stages):
    p = program(name, mode="sync", stages=stages)
    for seed in (1, 2):
        inputs = guided_inputs(name, seed)
        assert_rel_close(run(name, p, inputs), eager(name, inputs))


@pytest.mark.parametrize("name", VIDEO)
def test_stale_with_warmup_on_every_call_equals_eager(name):
    p = program(name, mode="stale", stages=2, warmup_steps=3)
    for seed in (1, 2, 3):
        inputs = guided_inputs(name, seed)
        assert_rel_close(run(name, p, inputs), eager(name, inputs))


@pytest.mark.parametrize("name", VIDEO)
def test_stale_on_repeated_input_equals_eager(name):
    p = program(name, mode="stale", stages=2, warmup_steps=1)
    inputs = guided_inputs(name, 4)
    run(name, p, inputs)
    assert_rel_close(run(name, p, inputs), eager(name, inputs))


@pytest.mark.parametrize("name", VIDEO)
def test_stale_on_changing_input_is_stale(name):
    p = program(name, mode="stale", stages=2, warmup_steps=1)
    first, second = guided_inputs(name, 5), guided_inputs(name, 6)
    second["timestep"] = first["timestep"] * 0.5  # the next step: a lower timestep
    run(name, p, first)
    assert rel_error(run(name, p, second), eager(name, second)) > 1e-4

