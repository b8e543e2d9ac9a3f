"""Rates measured on a GPU (costmodel/gpu_rates.py): the fits from measured times, and on a
CUDA device the measurement itself."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.costmodel import calibrate, gpu_rates
from tokpipe_compiler.costmodel.symbolic import padded_head

BASE = calibrate.DeviceRates(matmul_flops=1e14, mem_bandwidth=1e12, attention_flops=1e14,
                             per_op_overhead=1e-5, matmul_half=64.0)


def test_full_waves_are_fitted_to_the_measured_product():
    rates = gpu_rates.wave_rates(BASE, 132, (8192, 4096, 4096), 2e-4)
    assert rates.sms == 132
    assert rates.gemm_seconds(8192, 4096, 4096) == pytest.approx(2e-4)
    # 2048 tiles are 16 waves of 132 (15.5 full): the full-wave rate is above the average
    assert rates.matmul_flops > 2 * 8192 * 4096 * 4096 / 2e-4
    assert rates.per_op_overhead == BASE.per_op_overhead  # the rest is kept


def test_attention_per_score_from_two_head_dims():
    """The H200's graphed SDPA over 2 x 16 heads, 4096 queries and keys: heads of 64 at
    479 TFLOP/s, of 128 at 685. The fit gives both back, and heads of 72 cost what heads of
    128 cost (measured: 390 TFLOP/s, 0.57x of 685 for 0.56x of the FLOPs)."""
    scores = 2 * 16 * 4096 * 4096
    small, large = (4 * scores * d / (tflops * 1e12) for d, tflops in ((64, 479), (128, 685)))
    rates = gpu_rates.score_rates(BASE, scores, small, large)
    assert rates.attention_by_score(scores, 4 * scores * 64) == pytest.approx(small)
    assert rates.attention_by_score(scores, 4 * scores * 128) == pytest.approx(large)
    d72 = rates.attention_by_score(scores, 4 * scores * padded_head(72))
    assert 4 * scores * 72 / d72 / 1e12 == pytest.approx(390, rel=0.05)


def test_times_that_do_not_fit_leave_the_flat_rate():
    scores = 1 << 20
    assert gpu_rates.score_rates(BASE, scores, 2e-5, 1e-5) == BASE  # larger heads faster
    assert gpu_rates.score_rates(BASE, scores, 1e-5, 3e-5) == BASE  # no time per score


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device")
def test_a_cuda_device_is_measured_in_waves_and_scores():
    rates = calibrate.measure_rates("cuda")
    props = torch.cuda.get_device_properties(0)
    assert rates.sms == props.multi_processor_count
    assert 1e13 < rates.matmul_flops < 1e16
    assert rates.score_seconds > 0 and rates.attention_flops > 0
