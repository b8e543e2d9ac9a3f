"""Compiled models come and go without leaking: 50 compile/run/del cycles, and parallelized
pipelines (each a ring whose step function is defined once) past Dynamo's recompile limit.

The cycles run in a fresh process: its resident memory is this test's alone, and its
`gc.collect()` scans a small heap (in the suite's process, after hundreds of tests, the 50
collections and compiles took minutes; alone, a cycle takes a fraction of a second)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import weakref
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.fixtures.models import TinyDiT, dit_inputs

pytestmark = pytest.mark.slow

CYCLES = 50


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def cycles(count: int) -> tuple[list[bool], list[float]]:
    """Per cycle: whether the model's weights outlived it, and the resident MiB after it."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    inputs = dit_inputs(TinyDiT(grid=8), 8)
    weights, resident = [], []
    for _ in range(count):
        model = TinyDiT(depth=2, width=128, heads=4, grid=8).eval()  # 1.1 MB of weights
        compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                                 options={"stages": 2, "chunks": 2, "compiler": "eager"})
        with torch.no_grad():
            compiled(*inputs)
            compiled(*inputs)
        weights.append(weakref.ref(next(model.parameters())))
        del model, compiled
        gc.collect()
        resident.append(resident_mib())
    return [ref() is not None for ref in weights], resident


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_memory_is_flat_over_compile_run_del_cycles():
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        alive, resident = pool.submit(cycles, CYCLES).result(timeout=600)
    assert len(resident) == CYCLES
    assert not any(alive), "a model's weights outlived it"
    # Leaking one model's weights and caches per cycle would add ~50 MB over 40 cycles.
    assert resident[-1] - resident[9] < 20, resident


def pipeline_cycles(count: int) -> tuple[list[bool], list[str]]:
    """Per cycle a new pipeline parallelized and run as a ring: whether its transformer's
    weights outlived it; and the warnings logged (a reset of Dynamo says so)."""
    import logging

    import tokpipe_compiler as tp
    from tests.fixtures.pipelines import generate, pixart_alpha

    torch.set_num_threads(1)
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("tokpipe_compiler").addHandler(handler)
    weights = []
    for _ in range(count):
        pipe, kwargs = pixart_alpha()
        tp.pipelines.parallelize(pipe, stages=2, chunks=2, compiler="eager")
        generate(pipe, kwargs, steps=3)
        weights.append(weakref.ref(next(pipe.transformer.parameters())))
        del pipe, kwargs
        gc.collect()
    return [ref() is not None for ref in weights], logged


def test_parallelized_pipelines_are_freed_past_the_recompile_limit():
    """Every ring's step function has one code object, on which Dynamo keeps the entries of
    each trace; they held each pipeline's transformer, and the 9th pipeline hit Dynamo's
    recompile limit and reset every compiled function in the process."""
    count = torch._dynamo.config.recompile_limit + 2
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        alive, logged = pool.submit(pipeline_cycles, count).result(timeout=600)
    assert len(alive) == count and not any(alive), alive
    assert not [m for m in logged if "reset" in m], logged
