"""Weight-only quantized models (tensor subclasses, as torchao makes them): pipelined like
any other, and their weights counted at the bytes they hold, not at the float dtype they
report (which made a plan's weights and memory four times too large for int8).

Tolerance: assert_equivalent's float32 default, 1e-5 relative to the eager output (eager
runs the same quantized weights).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.quantized import Int8Weight, quantize_linears
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
