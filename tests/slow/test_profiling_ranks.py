"""A profiled 2-rank run over gloo: each rank's trace holds its own stage's ranges for every
chunk and the receives from the rank before it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.runtime.launch import launch

pytestmark = pytest.mark.slow

CHUNKS = 2


def _profiled_rank(rank: int, world: int, options: dict) -> list[str]:
    """The names of the ranges in this rank's Chrome trace of a warmup and a chunked call."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    inputs = dit_inputs(model, 8)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(*inputs)  # step 0: warmup, whole sequence
        compiled(*inputs)  # step 1: chunked
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"rank{rank}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("tokpipe/")]


def test_each_rank_profiles_its_stage_and_its_receives():
    options = {"stages": 2, "chunks": CHUNKS, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager", "timeout": 60.0}
    first, second = launch(_profiled_rank, 2, args=(options,), timeout=240)
    assert "tokpipe/stage1/whole/step0" in second
    for chunk in range(CHUNKS):
        assert f"tokpipe/stage1/chunk{chunk}/step1" in second
        assert f"tokpipe/stage0/chunk{chunk}/step1" in first
        received = [n for n in second if n.startswith(f"tokpipe/stage0/chunk{chunk}/step1/recv")]
        assert len(received) == 1 and "<-rank0/" in received[0]
        assert received[0].endswith(" values") and not received[0].endswith("/0 values")
        sent = [n for n in first if n.startswith(f"tokpipe/stage0/chunk{chunk}/step1/send")]
        assert len(sent) == 1 and "->rank1/" in sent[0]
    assert not any(n.startswith("tokpipe/stage1/") for n in first)  # rank 0 runs stage 0 only
