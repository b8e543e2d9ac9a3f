"""Writes into a graph's inputs at its start run before the pipeline, on the whole inputs
(planning/graph_head.py): a model that zeroes rows of a token-aligned input in place, as
GLM-Image does with its dropped prior tokens, is pipelined instead of refused."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.fx

import tokpipe_compiler as tp
from tests.fixtures.models import DropsPriorTokens, dit_inputs
from tests.fixtures.tracing import rel_error
from tokpipe_compiler.planning.graph_head import split_head

OPTIONS = {"stages": 2, "chunks": 4, "warmup_steps": 1, "compiler": "eager"}
TIMESTEPS = (900, 800, 700)


def _inputs(model: DropsPriorTokens) -> tuple[torch.Tensor, ...]:
    latents, _, labels = dit_inputs(model, 8)
    prior = torch.randn(latents.shape[0], model.pos.shape[1], model.PRIOR_WIDTH)
    drop = torch.zeros(prior.shape[:2], dtype=torch.bool)
    drop[:, 1::3] = True
    return latents, labels, prior, drop


def _calls(model, latents, labels, prior, drop, mode: str) -> tuple[list, list, object]:
    """The compiled model's outputs at TIMESTEPS, and the prior each call was given."""
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": mode})
    outputs, priors = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in TIMESTEPS:
            priors.append(prior.clone())
            outputs.append(compiled(latents, torch.tensor([t]), labels, priors[-1], drop))
    return outputs, priors, compiled


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_a_write_into_an_input_at_a_graphs_start_runs_before_the_pipeline(mode):
    """It raised UnchunkableOps (a write of token values into a graph input). Now the graph
    Dynamo resumes after the masked read is pipelined: sync equals eager, stale equals the
    same model given the prior zeroed beforehand, and the caller's prior is written as
    eager writes it."""
    torch.manual_seed(0)
    model = DropsPriorTokens(depth=2, grid=8).eval()
    latents, labels, prior, drop = _inputs(model)
    outputs, priors, compiled = _calls(model, latents, labels, prior, drop, mode)
    assert tp.programs(compiled)  # pipelined, not run as traced
    zeroed = prior.masked_fill(drop[..., None], 0.0)
    for given in priors:
        assert torch.equal(given, zeroed)
    torch.compiler.reset()
    expected, _, _ = _calls(model, latents, labels, zeroed, torch.zeros_like(drop), mode)
    for got, want in zip(outputs, expected, strict=True):
        assert rel_error(got, want) <= 1e-6
    with torch.no_grad():
        eager = model(latents, torch.tensor([TIMESTEPS[-1]]), labels, prior.clone(), drop)
    assert (rel_error(outputs[-1], eager) <= 1e-5) == (mode == "sync")


def _split(fn):
    gm = torch.fx.symbolic_trace(fn)
    return gm, split_head(gm)


def _resumed() -> torch.fx.GraphModule:
    """The graph Dynamo resumes `prior[drop] *= 0.0` with: rows = prior[drop] read before
    the break, then `rows *= 0.0; prior[drop] = rows; return x + prior * 2`."""
    graph = torch.fx.Graph()
    prior, drop, rows, x = (graph.placeholder(n) for n in ("prior", "drop", "rows", "x"))
    zeroed = graph.call_function(operator.imul, (rows, 0.0))
    graph.call_function(operator.setitem, (prior, drop, zeroed))
    doubled = graph.call_function(operator.mul, (prior, 2))
    graph.output(graph.call_function(operator.add, (x, doubled)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_head_writes_the_inputs_and_the_body_reads_them():
    gm = _resumed()
    split = split_head(gm)
    assert split is not None and split.ops == ("imul (imul)", "setitem (setitem)")
    assert {n.target for n in split.body.graph.nodes} & {operator.imul, operator.setitem} \
        == set()
    prior, x = torch.randn(2, 6, 3), torch.randn(2, 6, 3)
    drop = torch.rand(2, 6) > 0.5
    args = (prior, drop, prior[drop], x)
    mine = tuple(a.clone() for a in args)
    expected = gm(*args)
    assert torch.equal(split.run(split.body, *mine), expected)
    assert torch.equal(mine[0], prior)  # the caller's input, written


@pytest.mark.parametrize(("fn", "head"), [
    (lambda p, x: (p * 2 + x, p.mul_(0.5))[0], False),       # read before the write
    (lambda p, x: x + p.sum() + p.sub_(p.sum()), False),     # its operand read before it
    (lambda p, x: (p.mul_(x), p.add_(x.sum()))[1] + x, True),  # two writes, read after
    (lambda p, x: p.add_(x * 2) + x * 2, True),              # the same value computed again
], ids=["read_before", "operand_read_before", "two_writes", "recomputed"])
def test_a_head_is_split_off_only_where_running_it_first_changes_nothing(fn, head):
    gm, split = _split(fn)
    assert (split is not None) == head
    if split is not None:
        p, x = torch.randn(4, 3), torch.randn(4, 3)
        mine = (p.clone(), x.clone())
        expected = gm(p, x)
        assert torch.equal(split.run(split.body, *mine), expected)
        assert torch.equal(mine[0], p)  # written as the graph writes it
