"""Inductor-compiled stages compute what the eager stage graphs compute.

One compiled program is shared by the module (each stage compiles once per chunk length,
10-60 s on a small CPU). Tolerance: float32, 1e-5 relative to the largest eager value.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close, trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def programs():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    options = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1}
    return model, traced, traced.program(compiler="inductor", **options), \
        traced.program(compiler="eager", **options)


def test_inductor_stages_equal_eager_stages(programs):
    model, traced, compiled, eager = programs
    for seed in range(3):  # warmup (whole sequence), then two stale steps (chunks)
        latents, t, labels = dit_inputs(model, 8, seed=seed)
        args = traced.args(latents=latents, timestep=t, labels=labels)
        (got,) = compiled(*args)
        (expected,) = eager(*args)
        assert_rel_close(got, expected)
    assert set(compiled.stage_programs[0].compiled) == {(2, True), (4, True)}  # 2 rows, all 4


def test_inductor_compiles_the_attention_custom_op(programs):
    _, _, compiled, _ = programs
    graph = compiled.stage_programs[0].graph_for(2)
    assert any("kv_attention" in str(n.target) for n in graph.graph.nodes)
