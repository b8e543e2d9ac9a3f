"""Calibration on a busy machine (costmodel/measure.py) and the rates cache's checks: a
disturbed measurement is measured again, refused when it stays implausible, and never
cached; cached rates count only for the hardware, threads and torch they were measured on."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from tokpipe_compiler.costmodel import calibrate, measure

GOOD = calibrate.DeviceRates(matmul_flops=1e11, mem_bandwidth=8e10, attention_flops=5e10,
                             per_op_overhead=1e-6, matmul_half=8.0)
# At 2 threads on a 2-core machine with a core taken: 1 GB/s and a quarter of the matmul
# rate of one thread (as measured there, 2026-12).
DISTURBED = replace(GOOD, mem_bandwidth=1.1e9, matmul_flops=2.5e10)


def test_bandwidth_is_measured_before_the_matmuls(monkeypatch):
    """After a few products a 2-thread add ran at 1.8 GB/s against 153 fresh: the old
    order (products first) baked that in."""
    order = []
    monkeypatch.setattr(measure, "bandwidth", lambda *a: order.append("bandwidth") or 8e10)
    monkeypatch.setattr(measure, "matmul_fit", lambda *a: order.append("matmul") or (1e11, 8.0))
    monkeypatch.setattr(measure, "attention_rate", lambda *a: 5e10)
    monkeypatch.setattr(measure, "overhead", lambda *a: 1e-6)
    monkeypatch.setattr(measure, "causal_tile", lambda *a: 64.0)
    assert measure.one_round("cpu", torch.float32).mem_bandwidth == 8e10
    assert order == ["bandwidth", "matmul"]


def test_implausible_figures_are_named():
    assert measure.problems(GOOD) == []
    assert measure.problems(GOOD, single=GOOD) == []
    found = measure.problems(DISTURBED, single=GOOD)
    assert any(p.startswith("mem_bandwidth 1.1e+09 is outside") for p in found)
    assert any("below 50% of one thread's 8e+10" in p for p in found)
    assert any(p.startswith("matmul rate at 512 rows") for p in found)


def _rounds(monkeypatch, results: list[calibrate.DeviceRates]) -> list[int]:
    """measure.measure's rounds return `results` in turn, one thread measures GOOD."""
    calls = []

    def one_round(device, dtype):
        calls.append(1)
        return results[len(calls) - 1]

    monkeypatch.setattr(measure, "one_round", one_round)
    monkeypatch.setattr(measure, "single_thread", lambda device, dtype: GOOD)
    return calls


def test_a_disturbed_round_is_measured_again(monkeypatch):
    calls = _rounds(monkeypatch, [DISTURBED, GOOD, DISTURBED])
    with torch.no_grad():
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            rates = measure.measure("cpu", torch.float32)
        finally:
            torch.set_num_threads(previous)
    assert len(calls) == 2 and rates.mem_bandwidth == GOOD.mem_bandwidth
    assert rates.matmul_flops == GOOD.matmul_flops


def test_rates_that_stay_implausible_are_refused_and_not_cached(tmp_path, monkeypatch):
    """Three disturbed rounds raise, naming the figures; load_or_measure warns, plans with
    one thread's figures where higher and caches nothing, so the next process measures."""
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(calibrate, "_UNCACHED", {})  # this test's process-wide fallback
    _rounds(monkeypatch, [DISTURBED] * measure.ROUNDS)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(measure.CalibrationError, match=r"mem_bandwidth 1.1e\+09"):
            measure.measure("cpu", torch.float32)
        _rounds(monkeypatch, [DISTURBED] * measure.ROUNDS)
        with pytest.warns(UserWarning, match=r"implausible rates.*not cached"):
            rates = calibrate.load_or_measure("cpu", 2, refresh=True)
    finally:
        torch.set_num_threads(previous)
    assert rates.mem_bandwidth == GOOD.mem_bandwidth and rates.matmul_flops == GOOD.matmul_flops
    assert not calibrate.cache_path("cpu", 2).exists()
    monkeypatch.setattr(measure, "one_round", lambda *a: pytest.fail("measured again"))
    assert calibrate.load_or_measure("cpu", 2) == rates  # once a process, not every call


def test_a_noisy_matmul_fit_falls_back_to_the_best_rate(monkeypatch):
    """A fit that puts half the rate far past the largest product measured (4132 rows, a
    peak of 3.75e11 FLOP/s at 2 threads) is noise: the best rate seen is used instead."""
    def rate(m: int) -> float:
        return 3.75e11 * m / (m + 4132)

    times = iter(2 * m * 1024 * 1024 / rate(m) for m in measure.MATMUL_ROWS)
    monkeypatch.setattr(measure, "time_call", lambda fn, device: next(times))
    peak, half = measure.matmul_fit("cpu", torch.float32)
    assert (peak, half) == (pytest.approx(rate(512)), 0.0)


def test_the_cache_holds_for_its_hardware_threads_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(calibrate, "measure_rates", lambda d, t: calls.append(t) or GOOD)
    assert calibrate.load_or_measure("cpu", 2) == GOOD and calibrate.load_or_measure("cpu", 2)
    assert calls == [2]
    path = calibrate.cache_path("cpu", 2)
    saved = json.loads(path.read_text())
    assert saved["key"] == calibrate.cache_key("cpu", 2)
    assert saved["key"]["torch"] == torch.__version__ and "cores" in saved["key"]["hardware"]
    for change in ({"torch": "1.0"}, {"hardware": "another CPU"}, {"threads": 1}):
        path.write_text(json.dumps({**saved, "key": {**saved["key"], **change}}))
        calibrate.load_or_measure("cpu", 2)
    assert len(calls) == 4
    path.write_text(json.dumps(asdict(GOOD)))  # the old format: no key
    calibrate.load_or_measure("cpu", 2)
    bad = {**saved, "rates": asdict(DISTURBED)}  # written before the checks
    path.write_text(json.dumps(bad))
    calibrate.load_or_measure("cpu", 2)
    assert len(calls) == 6


def test_save_rates_is_what_load_or_measure_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(calibrate, "measure_rates", lambda d, t: pytest.fail("measured"))
    calibrate.save_rates(GOOD, "cpu", 5)
    assert calibrate.load_or_measure("cpu", 5) == GOOD
