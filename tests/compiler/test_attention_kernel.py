"""The `attention` option: "sdpa" (cache copy, then the library's attention) or "triton"
(the fused kernel, emitted only for CUDA layers without masks or text segments)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close, trace
from tokpipe_compiler.passes import chunk_attention as chunk_attention_module
from tokpipe_compiler.runtime import triton_attention

pytest.importorskip("triton")


def dit_case():
    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    return model, dit_inputs(model, 8), "stale"


def lm_case():
    model = TinyCausalLM(depth=2, width=16, heads=2).eval()
    return model, (torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0)),), "causal"


def run(program, inputs, calls: int = 3) -> list[torch.Tensor]:
    with torch.no_grad():
        return [program(*inputs)[0] for _ in range(calls)]


def kernels(program) -> list[str]:
    """Which kernel every kv_attention call in the program's stage graphs asks for."""
    return ["triton" if node.kwargs.get("fused") else "sdpa" for stage in program.plan.stages
            for node in stage.graph.gm.graph.nodes
            if node.target is torch.ops.tokpipe.kv_attention.default]


def test_triton_on_cpu_tensors_warns_and_runs_sdpa():
    model, inputs, mode = dit_case()
    traced = trace(model, *inputs)
    with pytest.warns(UserWarning, match=r"attention='triton': 2 of 2 attention layers run "
                                         r"with SDPA instead.*its tensors are on cpu"):
        fused = traced.program(stages=2, chunks=4, mode=mode, attention="triton")
    plain = traced.program(stages=2, chunks=4, mode=mode)
    assert kernels(fused) == kernels(plain) == ["sdpa", "sdpa"]
    for got, expected in zip(run(fused, traced.inputs), run(plain, traced.inputs), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case, compiler", [(dit_case, "eager"), (lm_case, "eager"),
                                            (dit_case, "inductor")],
                         ids=["dit-stale", "lm-causal", "dit-stale-inductor"])
def test_triton_layers_call_the_fused_kernel(monkeypatch, case, compiler):
    """As on a GPU (the layer check says yes): every layer's op calls the fused kernel, here
    its float64 reference, which has the kernel's contract (cache store, then attention)."""
    calls = []

    def fused(q, k, v, k_cache, v_cache, offset, kv_len, causal, scale=None):
        calls.append((offset, kv_len, causal))
        return triton_attention.reference_kv_attention(q, k, v, k_cache, v_cache, offset,
                                                       kv_len, causal, scale)

    monkeypatch.setattr(chunk_attention_module, "_why_unfused", lambda *args: "")
    monkeypatch.setattr(triton_attention, "fused_kv_attention", fused)
    model, inputs, mode = case()
    traced = trace(model, *inputs)
    program = traced.program(stages=2, chunks=4, mode=mode, attention="triton",
                             compiler=compiler)
    assert kernels(program) == ["triton", "triton"]
    got = run(program, traced.inputs)
    causal = mode == "causal"
    assert calls and all(c == causal for _, _, c in calls)
    assert {offset for offset, _, _ in calls} >= {0, 12}  # every chunk's offset (4 tokens)
    expected = run(traced.program(stages=2, chunks=4, mode=mode), traced.inputs)
    for g, e in zip(got, expected, strict=True):
        assert_rel_close(g, e)
