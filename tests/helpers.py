"""Shared test plumbing: trace a model once, then build many pipelined programs from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokpipe_compiler import Config
from tokpipe_compiler.driver import build_plan
from tokpipe_compiler.graph_utils import record_sources
from tokpipe_compiler.program import PipelinedProgram


@dataclass
class Traced:
    """One Dynamo graph of a model and the inputs it was traced with."""

    gm: torch.fx.GraphModule
    inputs: list[Any]
    names: list[str]

    def args(self, **replace: torch.Tensor) -> list[Any]:
        """The graph's inputs with some user inputs replaced, by argument name."""
        out = list(self.inputs)
        for key, value in replace.items():
            out[self.names.index(f"l_{key}_")] = value
        return out

    def program(self, **options: Any) -> PipelinedProgram:
        options.setdefault("compiler", "eager")
        return PipelinedProgram(build_plan(self.gm, Config(**options)))


def trace(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Traced:
    graphs: list[Traced] = []

    def record(gm, example_inputs, **_):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append(Traced(record_sources(gm), list(example_inputs), names))
        return gm.forward

    torch._dynamo.reset()  # tests trace many models of one class: start each from scratch
    with torch.no_grad():
        torch.compile(model, backend=record, dynamic=False)(*args, **kwargs)
    assert len(graphs) == 1, f"expected one graph, Dynamo made {len(graphs)}"
    return graphs[0]


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """max |actual - expected| <= rel * max |expected| (norm-relative, float32 default 1e-5)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3e} > {rel:g} * {scale:.3e}"


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual - expected).abs().max().item() / expected.abs().max().item()
