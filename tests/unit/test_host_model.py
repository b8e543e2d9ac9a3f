"""The host's time per call (costmodel/host.py): which host a plan assumes, how it bounds a
chunk, and the warning a CUDA plan gives when its chunks would run at the host's pace."""

from __future__ import annotations

import warnings

import pytest

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.costmodel import planning_costs
from tokpipe_compiler.costmodel.hardware import DEVICES
from tokpipe_compiler.costmodel.host import (
    NO_HOST,
    TOKPIPE_H200,
    TOKPIPE_H200_GRAPHS,
    HostModel,
    assume_host,
    planning_host,
    runtime_host,
)


def test_a_chunk_takes_the_longer_of_its_device_and_host_time():
    host = HostModel(per_launch_s=1e-5, per_call_s=1e-4)
    assert host.call_seconds(10) == pytest.approx(2e-4)
    bounded = host.bound(lambda n, c, text=1.0: n * 1e-6, lambda text: 10 * text)
    assert bounded(100, 100) == pytest.approx(2e-4)  # 0.1 ms of work, 0.2 ms to launch
    assert bounded(1000, 1000) == pytest.approx(1e-3)
    assert bounded(100, 100, 0.0) == pytest.approx(1e-4)  # no text: no text launches

    def device(n, c, text=1.0):
        return n

    assert NO_HOST.bound(device, lambda text: 1.0) is device


def test_plans_assume_the_runtimes_host_on_cuda_only():
    assert runtime_host("cpu", False) == NO_HOST
    assert runtime_host("cuda:0", False) == TOKPIPE_H200
    assert runtime_host("cuda:1", True) == TOKPIPE_H200_GRAPHS
    assert TOKPIPE_H200_GRAPHS.per_launch_s == 0 < TOKPIPE_H200.per_launch_s
    with assume_host(NO_HOST):
        assert planning_host("cuda:0", False) == NO_HOST
    assert planning_host("cuda:0", False) == TOKPIPE_H200


@pytest.fixture
def as_if_on_an_h200(monkeypatch):
    """Plans on this CPU priced as if the model's inputs were on an H200."""
    rates = DEVICES["h200"].rates()
    monkeypatch.setattr(planning_costs, "token_device", lambda token_input: "cuda:0")
    monkeypatch.setattr(planning_costs, "device_rates", lambda token_input: ("cuda:0", rates))


def explain(width: int = 64, grid: int = 16, **options):
    model = TinyDiT(depth=4, width=width, heads=4, grid=grid).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = tp.explain(model, dit_inputs(model, grid, batch=2), stages=2, **options)
    return plan, [str(w.message) for w in caught if "launch" in str(w.message)]


def test_a_launch_bound_cuda_plan_says_so_and_names_the_option(as_if_on_an_h200):
    _, said = explain(chunks=4)
    assert len(said) == 1 and "cuda_graphs=True" in said[0] and "2 of 2 stages" in said[0]
    assert explain(chunks=4, cuda_graphs=True)[1] == []
    assert explain(chunks=1)[1] == []  # nothing chunked: nothing to advise


def test_a_plan_on_this_cpu_does_not_warn():
    assert explain(chunks=4)[1] == []


def test_auto_chunks_on_cuda_count_the_hosts_time(as_if_on_an_h200):
    """DiT-S width, 4096 tokens, at an H200's rates: a host that keeps ahead makes 5 chunks
    fit the GPU's waves best; launching each kernel (20 us) makes every chunk cost its
    launches, so as few as there are stages win; a graph's replay (0.2 ms a call) lies
    between."""
    size = {"width": 384, "grid": 128, "chunks": "auto"}
    with assume_host(NO_HOST):
        free, _ = explain(**size)
    launched, _ = explain(**size)
    graphed, _ = explain(**size, cuda_graphs=True)
    assert len(launched.chunks) == 2 < len(graphed.chunks) < len(free.chunks)
