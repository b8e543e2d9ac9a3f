"""What the runtime hands a stage per chunk (StageFeeds), and the per-call prelude compiled
or, where Inductor fails, run eagerly with a warning."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from tokpipe_compiler.core.stage_graph import BOUNDARY, CALL, SLICED, StageGraph, StageInput
from tokpipe_compiler.runtime.chunking import chunk_table
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT
from tokpipe_compiler.runtime.stage_feeds import StageFeeds
from tokpipe_compiler.stage_programs.prelude import Prelude


def _stage() -> StageGraph:
    """A stage reading a weight, a boundary value, the token input cut to the chunk and the
    chunk descriptor (its graph is not run here)."""
    inputs = [StageInput("w", CALL, "w"), StageInput("h", BOUNDARY, "h", producer=0),
              StageInput("x_chunk", SLICED, "x", axis=1, per_unit=2),
              StageInput(CHUNK_INPUT, CALL, CHUNK_INPUT)]
    return StageGraph(1, torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), inputs,
                      ["out"])


def test_each_chunk_gets_its_slice_its_values_and_the_steps_per_call_values():
    feeds = StageFeeds([_stage(), _stage()])
    chunks = chunk_table(3, 3)
    env = {"w": torch.ones(2), "x": torch.arange(12.0).reshape(1, 6, 2)}
    w, h, x, descriptor = feeds.inputs(1, chunks[1], 3, env, {"h": torch.zeros(1)})
    assert w is env["w"]
    assert torch.equal(h, torch.zeros(1))
    assert torch.equal(x, env["x"][:, 2:4])
    assert descriptor.tolist() == [1, 1, 3]  # start, units, visible
    # The next step's values are a new env: its weights are read again, not kept.
    later = {**env, "w": torch.full((2,), 2.0)}
    assert feeds.inputs(1, chunks[1], 3, later, {"h": torch.zeros(1)})[0] is later["w"]


def test_a_carried_value_replaces_the_slice_and_descriptors_are_made_once():
    feeds = StageFeeds([_stage(), _stage()])
    chunk = chunk_table(4, 2)[1]
    env = {"w": torch.ones(2), "x": torch.zeros(1, 8, 2)}
    carried = torch.ones(1, 4, 2)
    first = feeds.inputs(1, chunk, 4, env, {"h": torch.zeros(1), "x_chunk": carried})
    assert first[2] is carried
    again = feeds.inputs(1, chunk, 4, env, {"h": torch.zeros(1)})
    assert again[3] is first[3]  # the same descriptor tensor for the same chunk and view
    assert feeds.inputs(1, chunk, 2, env, {"h": torch.zeros(1)})[3].tolist() == [2, 2, 2]


def _prelude_graph() -> torch.fx.GraphModule:
    def conditioning(t, w):
        return torch.sin(t) * w, (t + 1).relu()

    return torch.fx.symbolic_trace(conditioning)


def test_the_prelude_compiles_with_inductor_and_computes_what_eager_does():
    gm = _prelude_graph()
    args = (torch.randn(4), torch.randn(4))
    compiled = Prelude(gm, ["a", "b"], "inductor")
    out = compiled(*args)
    assert compiled._fn is not compiled.gm  # compiled, not the FX graph
    expected = dict(zip(["a", "b"], gm(*args), strict=True))
    for name in expected:
        torch.testing.assert_close(out[name], expected[name], rtol=1e-5, atol=0)


def test_a_prelude_inductor_cannot_compile_runs_eagerly_with_a_warning(monkeypatch):
    def failing(gm, args):
        raise RuntimeError("unsupported op")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", failing)
    gm = _prelude_graph()
    args = (torch.randn(4), torch.randn(4))
    fallback = Prelude(gm, ["a", "b"], "inductor")
    with pytest.warns(UserWarning, match="prelude runs eagerly.*unsupported op"):
        out = fallback(*args)
    assert torch.equal(out["a"], gm(*args)[0])
    assert fallback._fn is fallback.gm
    eager = Prelude(gm, ["a", "b"], "eager")
    assert eager._fn is eager.gm  # eager: never compiled


def test_inputs_the_prelude_passes_on_skip_its_compiled_graph():
    """Weights a stage reads are prelude outputs too: they are handed over as they are, and
    the compiled graph takes only the inputs it computes from and returns what it computes
    (28-block PixArt: 154 of 608 inputs, 254 of 708 outputs)."""

    def conditioning(t, w, unused_weight, passed_weight):
        return torch.sin(t) * w, passed_weight, (t + 1).relu(), t

    gm = torch.fx.symbolic_trace(conditioning)
    args = tuple(torch.randn(4) for _ in range(4))
    for compiler in ("eager", "inductor"):
        prelude = Prelude(gm, ["a", "p", "b", "t"], compiler)
        out = prelude(*args)
        assert [n.name for n in prelude.gm.graph.nodes if n.op == "placeholder"] == ["t", "w"]
        assert out["p"] is args[3] and out["t"] is args[0]
        expected = dict(zip(["a", "p", "b", "t"], gm(*args), strict=True))
        assert out.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(out[name], expected[name], rtol=1e-5, atol=0)
