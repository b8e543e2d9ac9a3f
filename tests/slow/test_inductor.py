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



def test_a_stage_compiled_again_is_read_from_inductors_cache():
    """Inductor's FX graph cache bypassed every stage compile ('No shape env'): each process
    compiled each stage anew. A second program of the same model (as a new process makes)
    reads its stage from the cache."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = TinyDiT(depth=1, width=32, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    latents, t, labels = dit_inputs(model, 8)
    args = traced.args(latents=latents, timestep=t, labels=labels)
    counters.clear()
    outs = [traced.program(compiler="inductor", stages=1, chunks=1, mode="sync")(*args)[0]
            for _ in range(2)]
    inductor = dict(counters["inductor"])
    assert inductor.get("fxgraph_cache_bypass", 0) == 0, inductor
    assert inductor.get("fxgraph_cache_hit", 0) >= 1, inductor
    assert_rel_close(outs[1], outs[0])


class ReluBlock(torch.nn.Module):
    """Attention and a ReLU MLP over tokens: the ReLU is what torch's test switch breaks."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv, self.mlp = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + torch.relu(self.mlp(x))


def test_an_inductor_failure_in_a_stage_names_the_stage_and_the_way_around():
    """It surfaced as Inductor's own error: 100 kB of g++ output, no stage, no hint."""
    import tokpipe_compiler as tp

    torch._dynamo.reset()
    model = torch.nn.Sequential(ReluBlock(), ReluBlock()).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"stages": 2, "chunks": 1, "mode": "sync"})
    with torch._inductor.config.patch({"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"}), \
            torch.no_grad(), pytest.raises(tp.TokpipeError) as err:
        compiled(torch.randn(1, 8, 16))
    text = str(err.value)
    assert "could not compile stage 0's graph for chunks of 8 token rows" in text, text
    assert "compiler='eager'" in text and len(text) < 600, text
