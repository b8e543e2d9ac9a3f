"""Transformers with hooks at their modules' calls (diffusers' layerwise casting and group
offloading, accelerate's offloading) run per call under parallelize, and say why: the
hooks cast or move weights as each module runs, which a ring's step, traced once, would
hold fixed, and which, run on the fake tensors of the ring's first-step probe, left the
weights fake (the transformer was unusable afterwards).

Tolerances: sync equals the serial pipeline with the same hooks within 1e-5 of the
output's largest value (float32 compute).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import flux, generate, pixart_alpha, wan
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


def test_group_offloaded_joint_blocks_with_as_many_text_as_image_tokens():
    """Offloading hooks split each Flux block at graph breaks; inside a block the text
    stream has the image stream's width, and with as many tokens (16 = 16 here) it has the
    image's shape too. It is still text: the image stream alone is chunked (it was taken
    for a second copy of the tokens and the joint concatenation refused)."""
    serial, kwargs = flux(true_cfg=False)
    tokens = (kwargs["height"] // 16) * (kwargs["width"] // 16)  # 2x2-packed latent pixels
    kwargs["prompt_embeds"] = torch.randn(1, tokens, kwargs["prompt_embeds"].shape[-1])
    _group_offload(serial.transformer)
    expected = generate(serial, kwargs, steps=2)
    pipe, _ = flux(true_cfg=False)
    _group_offload(pipe.transformer)
    tp.pipelines.parallelize(pipe, **{**OPTIONS, "mode": "stale", "warmup_steps": 2})
    with pytest.warns(UserWarning, match="runs per call"):
        out = generate(pipe, kwargs, steps=2)
    assert rel_error(out, expected) <= 1e-5  # stale within its warmup is exact


def test_model_offloading_pipelines_every_call_as_without_it():
    """accelerate's model offloading breaks the graph at the transformer's hook: Dynamo
    resumes in a frame whose inputs are the hook's returned (args, kwargs), where the
    timestep is still told by its keyword, and which is handed the model's rotary buffers
    anew at every call while its parameters stay. Stale mode then runs as it does without
    offloading (it made a new program, a first warmup step, at every call)."""
    options = {**OPTIONS, "mode": "stale", "ring": False, "warmup_steps": 1}
    plain, kwargs = wan()
    tp.pipelines.parallelize(plain, **options)
    expected = generate(plain, kwargs, steps=3)
    pipe, _ = wan()
    pipe.enable_model_cpu_offload(device="cpu")
    tp.pipelines.parallelize(pipe, **options)
    out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, expected) <= 1e-5
    assert [p.calls for p in tp.pipelines.programs(pipe)] == [6]  # 3 steps, 2 branches


def test_a_split_transformer_says_how_much_of_it_is_pipelined():
    """Group offloading splits the transformer at every block: after the call that planned
    its graphs, one line gives their count and the pipelined share; not again after a call
    that planned none."""
    pipe, kwargs = pixart_alpha()
    _group_offload(pipe.transformer)
    tp.pipelines.parallelize(pipe, **OPTIONS)
    with pytest.warns(UserWarning) as record:
        generate(pipe, kwargs, steps=2)
    lines = [str(w.message) for w in record if "graphs (Dynamo split it" in str(w.message)]
    assert len(lines) == 1, lines
    found = re.search(r"PixArtTransformer2DModel ran as (\d+) graphs .*: (\d+) pipelined, "
                      r"holding (\d+)% of its FLOPs, (\d+) run as traced", lines[0])
    assert found, lines[0]
    graphs, pipelined, percent, traced = (int(g) for g in found.groups())
    assert 0 < pipelined < graphs and pipelined + traced == graphs and 0 < percent < 100
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        generate(pipe, kwargs, steps=2)
    assert not [w for w in again if "graphs (Dynamo split it" in str(w.message)]


def _halve_output(module: Any, args: Any, out: Any) -> Any:
    return (out[0] * 0.5,) if isinstance(out, tuple) else type(out)(sample=out.sample * 0.5)


def _halve_input(module: Any, args: tuple, kwargs: dict) -> tuple:
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.5}
    return (args[0] * 0.5, *args[1:]), kwargs


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("register", [
    lambda t: t.register_forward_hook(_halve_output),
    lambda t: t.register_forward_pre_hook(_halve_input, with_kwargs=True),
], ids=["forward_hook", "pre_hook"])
def test_hooks_on_the_transformer_itself_run(register: Callable, ring: bool):
    """A ring's step calls the transformer's forward, not its module call: with hooks of
    its own it runs per call, saying so (they were dropped). Per call, the hook's own graph
    (Dynamo traces it apart from the forward) runs as traced (it was planned as a model of
    its own and refused: "stages=2 is more than this graph can be cut into")."""
    pipe, kwargs = pixart_alpha()
    register(pipe.transformer)
    expected = generate(pipe, kwargs, steps=2)
    tp.pipelines.parallelize(pipe, ring=ring, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(pipe, kwargs, steps=2)
    said = " ".join(str(w.message) for w in caught)
    assert rel_error(got, expected) <= 1e-5
    if ring:
        assert re.search(r"runs per call .*of its own, which run around its call", said)
    else:
        assert "running this graph unpipelined" in said
    assert tp.pipelines.programs(pipe)  # the forward itself was pipelined
