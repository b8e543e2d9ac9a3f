"""Compiled models come and go without leaking: 50 compile/run/del cycles."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.fixtures.models import TinyDiT, dit_inputs

pytestmark = pytest.mark.slow


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux only")
def test_memory_is_flat_over_compile_run_del_cycles():
    inputs = dit_inputs(TinyDiT(grid=8), 8)
    weights, resident = [], []
    for _ in range(50):
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
    assert all(ref() is None for ref in weights), "a model's weights outlived it"
    # Leaking one model's weights and caches per cycle would add ~50 MB over 40 cycles.
    assert resident[-1] - resident[9] < 20, resident
