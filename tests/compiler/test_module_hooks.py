"""Transformers with hooks at their modules' calls (diffusers' layerwise casting and group
offloading, accelerate's offloading) run per call under parallelize, and say why: the
hooks cast or move weights as each module runs, which a ring's step, traced once, would
hold fixed, and which, run on the fake tensors of the ring's first-step probe, left the
weights fake (the transformer was unusable afterwards).

Tolerances: sync equals the serial pipeline with the same hooks within 1e-5 of the
output's largest value (float32 compute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import generate, pixart_alpha
from tests.fixtures.tracing import rel_error
from tokpipe_compiler.pipelines.probes import output_structure

pytest.importorskip("diffusers")

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}


def _layerwise_casting(transformer: Any) -> None:
    transformer.enable_layerwise_casting(storage_dtype=torch.bfloat16,
                                         compute_dtype=torch.float32)


def _group_offload(transformer: Any) -> None:
    cpu = torch.device("cpu")
    transformer.enable_group_offload(onload_device=cpu, offload_device=cpu,
                                     offload_type="block_level", num_blocks_per_group=1)


@pytest.mark.parametrize(("hooks", "name"), [(_layerwise_casting, "layerwise_casting"),
                                             (_group_offload, "group_offloading")])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_transformer_with_hooks_runs_per_call_and_says_why(hooks: Callable, name: str,
                                                             when: str):
    """Hooks added before parallelize, or after a first ring generation."""
    serial, kwargs = pixart_alpha()
    hooks(serial.transformer)
    expected = generate(serial, kwargs, steps=3)
    pipe, _ = pixart_alpha()
    if when == "before":
        hooks(pipe.transformer)
    tp.pipelines.parallelize(pipe, **OPTIONS)
    if when == "after":
        generate(pipe, kwargs, steps=3)
        hooks(pipe.transformer)
    with pytest.warns(UserWarning, match=f"runs per call.*transformer runs hooks.*{name}"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, expected) <= 1e-5
    again = generate(pipe, kwargs, steps=3)  # the weights are intact
    assert rel_error(again, expected) <= 1e-5


class SwapsItsWeight(torch.nn.Module):
    """A forward that replaces its weight as it runs, as offloading hooks do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.linear.weight = torch.nn.Parameter(self.linear.weight.to(x.device) * 1)
        return self.linear(x)


def test_a_probe_that_replaced_the_weights_raises():
    """A hook the per-call reasons do not know: the probe says what it saw, instead of
    a later error far from the cause."""
    model = SwapsItsWeight()
    with pytest.raises(tp.TokpipeError, match=r"replaced or moved 1 of its weights \(weight"):
        output_structure(model.forward, {"x": torch.randn(2, 4)})
