"""A profiled 2-rank run over gloo: each rank's trace holds its own stage's ranges for every
chunk and the receives from the rank before it; the ranks' timelines merge into one trace."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import tokpipe_compiler as tp
from tests.compiler.test_timeline_merge import check_merged
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.inspection.timeline import chrome_trace, merge_traces
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

CHUNKS = 2


def _profiled_rank(rank: int, world: int, options: dict) -> tuple[list[str], dict]:
    """The names of the ranges in this rank's profile of a warmup and a chunked call, and
    the rank's own timeline as a Chrome trace."""
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
    names = [e["name"] for e in events
             if e.get("ph") == "X" and e["name"].startswith("tokpipe/")]
    return names, chrome_trace(tp.programs(compiled)[0].timeline)


def test_each_rank_profiles_its_stage_and_its_receives():
    options = {"stages": 2, "chunks": CHUNKS, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager", "timeout": 60.0}
    (first, timeline0), (second, timeline1) = launch(_profiled_rank, 2, args=(options,),
                                                     timeout=240)
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
    merged = merge_traces([timeline0, timeline1])
    check_merged(merged, world=2)
    sends = [e for e in merged["traceEvents"] if e["ph"] == "X" and e["cat"] == "send"]
    assert len(sends) == 1 + CHUNKS  # stage 0's outputs to rank 1, warmup and chunked
