"""Weight-only quantized models (tensor subclasses, as torchao makes them): pipelined like
any other, and their weights counted at the bytes they hold, not at the float dtype they
report (which made a plan's weights and memory four times too large for int8). Weights
unpacked in a module's forward (diffusers' GGUF linears) are unpacked in the stage that
uses them, not all at once ahead of the stages.

Tolerance: assert_equivalent's float32 default, 1e-5 relative to the eager output (eager
runs the same quantized weights).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.quantized import Int8Weight, dequantize_in_forward, quantize_linears
from tokpipe_compiler.core.tensor_bytes import storage_bytes
from tokpipe_compiler.testing import assert_equivalent


def model_and_inputs(quantized: bool) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    return quantize_linears(model) if quantized else model, dit_inputs(model, 8)


def test_a_quantized_weight_counts_its_int8_data_and_scales():
    weight = Int8Weight.of(torch.randn(64, 32))
    assert weight.numel() * weight.element_size() == 64 * 32 * 4  # what it reports
    assert storage_bytes(weight) == 64 * 32 + 64 * 4


def test_a_plan_counts_the_bytes_quantized_weights_hold():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        plans = {q: tp.explain(*model_and_inputs(q), stages=2, chunks=2) for q in (False, True)}
    model, _ = model_and_inputs(True)
    held = sum(storage_bytes(t) for t in [*model.parameters(), *model.buffers()])
    assert plans[True].model_param_bytes == held
    assert plans[True].model_param_bytes < plans[False].model_param_bytes / 2


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_quantized_weights_pipeline(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(*model_and_inputs(True), stages=2, chunks=2, mode=mode)


def unpacking_model() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    return dequantize_in_forward(model), dit_inputs(model, 8)


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_weights_unpacked_in_the_forward_pipeline(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(*unpacking_model(), stages=2, chunks=2, mode=mode)


def test_a_weight_unpacked_in_the_forward_is_unpacked_in_its_stage():
    """Hoisted into the per-call prelude, every block's float weight was held for the whole
    call (a GGUF model's floats, all at once): the prelude passes the int8 rows on, and each
    stage unpacks its own linears' weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = tp.explain(*unpacking_model(), stages=2, chunks=2)
    def unpacking(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in gm.graph.find_nodes(op="call_method", target="to")
                if "qweight" in n.args[0].name]

    # the prelude unpacks the weights of its own per-call work (the timestep's MLP) alone:
    # no value computed from the weights alone leaves it
    prelude = plan.graphs.prelude.graph
    unpacked = set(prelude.find_nodes(op="placeholder"))
    unpacked -= {n for n in unpacked if "latents" in n.name or "timestep" in n.name
                 or "labels" in n.name}
    for node in prelude.nodes:
        if node.op in ("call_function", "call_method") and \
                all(arg in unpacked for arg in node.all_input_nodes):
            unpacked.add(node)
    unpacked -= set(prelude.find_nodes(op="placeholder"))
    handed = {n.name for n in unpacked} & set(plan.graphs.prelude_outputs)
    assert not handed, handed
    for stage in plan.graphs.stages:
        assert unpacking(stage.gm)
        assert any("qweight" in i.name for i in stage.inputs)  # the int8 rows come in


def test_a_stage_costs_the_weights_it_unpacks_at_every_chunk():
    """A stage unpacks its weights once a chunk: its Cost (what chunks="auto" and the
    timeline predict from) counts that work, the same at every chunk size, on top of what
    the same model with float weights costs: a multiply a weight element (the int8 rows
    times their scales) and the bytes the cast and the multiply move."""
    torch.manual_seed(0)
    float_model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [tp.explain(model, inputs, stages=2, chunks=2) for model, inputs in
                 (unpacking_model(), (float_model, dit_inputs(float_model, 8)))]
    tokens = plans[0].tokens
    for unpacking, plain in zip(*(p.stages for p in plans), strict=True):
        linears = [n for n in unpacking.graph.gm.graph.nodes if n.op == "call_method"
                   and n.target == "to" and "qweight" in n.args[0].name]
        elements = sum(n.meta["example_value"].numel() for n in linears)
        extra = {n: [a - b for a, b in zip(unpacking.cost.at(n, tokens)[:2],
                                          plain.cost.at(n, tokens)[:2], strict=True)]
                 for n in (tokens // 4, tokens // 2, tokens)}
        flops, moved = zip(*extra.values(), strict=True)
        assert set(flops) == {elements} and len(set(moved)) == 1 and moved[0] > 0, extra
