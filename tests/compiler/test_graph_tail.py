"""A check at the end of a forward that mixes every token (a NaN guard, a norm) runs after
the pipeline, on its whole output (planning/graph_tail.py): stale and causal pipeline the
model instead of refusing it."""

from __future__ import annotations

import dataclasses
import operator
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import ChecksItsOutput, TinyDiT, dit_inputs
from tokpipe_compiler.core.errors import UnchunkableOps
from tokpipe_compiler.planning.graph_tail import plan_with_tail, split_tail


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Code shared across tests (nn.Sequential's forward) past Dynamo's recompile limit
    would run eagerly: each test traces afresh."""
    torch.compiler.reset()


OPTIONS = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}
TIMESTEPS = (900, 800, 700)


def _compiled_calls(model, latents, labels) -> tuple[list, object]:
    """The compiled model's outputs at TIMESTEPS (stale after the first)."""
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=dict(OPTIONS))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = [compiled(latents, torch.tensor([t]), labels) for t in TIMESTEPS]
    return outputs, compiled


@dataclasses.dataclass(frozen=True)
class _Planned:
    caches: list
    tail_ops: tuple = ()


def _with_check(check: str, out: torch.Tensor):
    return {"nan_guard": out, "norm": (out, out.norm()), "scaled": out / out.abs().amax()}[check]


def _relative(actual, expected) -> float:
    if isinstance(expected, tuple):
        return max(map(_relative, actual, expected))
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("check", ["nan_guard", "norm", "scaled"])
def test_a_check_on_the_output_runs_after_the_pipeline(check):
    """The checked model's pipeline computes what the plain model's does, the check then
    applied to its whole output; its warmup step is the model's own numbers."""
    torch.manual_seed(0)
    model = ChecksItsOutput(check, depth=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)
    plain = TinyDiT(depth=2, grid=8).eval()
    plain.load_state_dict(model.state_dict())
    checked, compiled = _compiled_calls(model, latents, labels)
    unchecked, _ = _compiled_calls(plain, latents, labels)
    assert len(tp.programs(compiled)) == 1  # pipelined, not run as traced
    with torch.no_grad():
        assert _relative(checked[0], model(latents, torch.tensor([900]), labels)) <= 1e-5
    for got, out in zip(checked, unchecked, strict=True):
        assert _relative(got, _with_check(check, out)) <= 1e-6
    assert _relative(unchecked[1], model(latents, torch.tensor([800]), labels)) > 1e-5


def _outputs(check: str, latents_of) -> None:
    torch.manual_seed(0)
    model = ChecksItsOutput(check, depth=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)
    _compiled_calls(model, latents_of(latents), labels)


def test_the_check_still_sees_the_output():
    with pytest.raises(FloatingPointError, match="NaN"):
        _outputs("nan_guard", lambda latents: latents.index_fill(2, torch.tensor([3]), torch.nan))


def test_a_reduction_that_attention_reads_is_still_refused():
    with pytest.raises(tp.TokpipeError, match="mix tokens"):
        _outputs("attends", lambda latents: latents)


def _graph(check) -> torch.fx.GraphModule:
    """x [1, 8, 4] -> x * 2, then `check`; a weight w [4] enters as the second input."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.placeholder("L_self_modules_lin_parameters_weight_")
    doubled = graph.call_function(operator.mul, (x, 2))
    total = graph.call_function(torch.sum, (doubled,))
    graph.output(check(graph, doubled, total, weight))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_body_and_tail_compose_to_the_graph():
    gm = _graph(lambda g, doubled, total, _: (doubled, g.call_function(operator.truediv,
                                                                        (doubled, total))))
    split = split_tail(gm, ["sum_1"])
    x, weight = torch.randn(1, 8, 4), torch.randn(4)
    assert [n.name for n in split.tail.graph.find_nodes(op="placeholder")] == ["mul"]
    for got, want in zip(split.run(split.body, x, weight), gm(x, weight), strict=True):
        assert torch.equal(got, want)


def test_attention_after_the_ops_is_no_tail():
    attend = torch.nn.functional.scaled_dot_product_attention
    gm = _graph(lambda g, doubled, total, _: (g.call_function(attend, (doubled, doubled,
                                                                       total)),))
    assert split_tail(gm, ["sum_1"]) is None


def test_a_matrix_product_after_the_ops_is_no_tail():
    """Attention the compiler could not chunk (here: its scores' product) would make the
    rest of the model a tail, unpipelined: it is refused as before."""
    gm = _graph(lambda g, doubled, total, weight: (g.call_function(torch.matmul, (
        g.call_function(operator.truediv, (doubled, total)), weight)),))
    assert split_tail(gm, ["sum_1"]) is None


def test_a_write_after_the_ops_is_no_tail():
    """`joint[:, 0] = total` changes what later readers of `joint` see, though they are no
    users of the write: no split keeps that order."""
    def check(g, doubled, total, _):
        g.call_function(operator.setitem, (doubled, 0, total))
        return (g.call_function(operator.mul, (doubled, 3)),)

    assert split_tail(_graph(check), ["sum_1"]) is None


def test_the_body_is_planned_where_the_ops_are_a_tail():
    gm = _graph(lambda g, doubled, total, _: (g.call_function(operator.truediv,
                                                              (doubled, total)),))
    planned = []

    def plan(graph):
        planned.append(graph)
        if len(planned) == 1:
            raise UnchunkableOps("mixes tokens", "", ("sum_1",))
        return _Planned(caches=["a K/V cache"])

    plan_result, split = plan_with_tail(gm, plan)
    assert plan_result.caches and planned[1] is split.body
    assert plan_result.tail_ops == ("sum_1",)
    x, weight = torch.randn(1, 8, 4), torch.randn(4)
    assert torch.equal(split.run(split.body, x, weight)[0], gm(x, weight)[0])


def test_explain_plans_the_body():
    torch.manual_seed(0)
    model = ChecksItsOutput("nan_guard", depth=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    plan = tp.explain(model, (latents, t, labels), **OPTIONS)
    assert len(plan.stages) == 2 and len(plan.chunks) == 4
    assert plan.tail_ops and plan.summary()["tail_ops"] == list(plan.tail_ops)
    printed = str(plan)
    assert "after the pipeline" in printed and all(op in printed for op in plan.tail_ops)


def test_a_plan_without_a_tail_says_nothing_of_one():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, grid=8).eval()
    plan = tp.explain(model, dit_inputs(model, 8), **OPTIONS)
    assert plan.tail_ops == () and "after the pipeline" not in str(plan)


class _Attention(torch.nn.Module):
    """Self-attention through sdpa, or (`relu`) with a ReLU for its softmax, which the
    compiler does not fold into sdpa: unchunkable where it stands."""

    def __init__(self, relu: bool):
        super().__init__()
        self.relu = relu
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.relu:
            a = (q @ k.transpose(-2, -1)).relu() @ v / n
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return h + self.out(a.transpose(1, 2).reshape(b, n, 16))


class _TwoBlocks(torch.nn.Module):
    """A block the compiler chunks, then one it cannot: the second's matrix products would
    make it an unpipelined tail."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _Attention(relu=False), _Attention(relu=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(h))


def test_attention_it_cannot_chunk_is_refused_not_made_a_tail():
    model = _TwoBlocks().eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=dict(OPTIONS))
    with torch.no_grad(), pytest.raises(tp.TokpipeError, match="mix tokens"):
        compiled(torch.randn(1, 16, 16))
