"""The memory report: the K/V the program holds is what the plan predicts, per branch."""

from __future__ import annotations

import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.inspection import memory
from tokpipe_compiler.inspection.memory import format_memory, memory_report


def test_held_kv_matches_the_plan_per_guidance_branch():
    model = TinyDiT(depth=2, width=32, heads=2, grid=16).eval()
    args = dit_inputs(model, 16)
    compiled = torch.compile(model, backend=tp.backend(stages=2, chunks=2, compiler="eager"),
                             dynamic=False)
    with torch.no_grad():
        compiled(*args)
    (program,) = tp.programs(compiled)
    report = memory_report(program)
    assert [s.stage for s in report.stages] == [0, 1]
    for s in report.stages:
        assert s.branches == 1 and s.kv_measured == s.kv_predicted > 0
        assert s.weights_predicted == program.plan.stages[s.stage].param_bytes
    assert report.peak > 0 and "peak" in format_memory(report)
    latents, t, labels = args
    with torch.no_grad():  # the same step, other inputs: a second guidance branch
        compiled(latents + 1, t, labels)
    assert all(s.branches == 2 and s.kv_measured == 2 * s.kv_predicted
               for s in memory_report(program).stages)


def test_the_report_names_the_process_by_its_world_rank(monkeypatch):
    """A hybrid cfg=2 ring's program has a rank in its branch's group of stages; the report
    names the process's world rank (else two processes would both be "rank 0")."""
    model = TinyDiT(depth=2, width=32, heads=2, grid=16).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=2, chunks=2, compiler="eager"),
                             dynamic=False)
    with torch.no_grad():
        compiled(*dit_inputs(model, 16))
    (program,) = tp.programs(compiled)
    assert memory_report(program).rank == program.rank == 0
    monkeypatch.setattr(memory.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(memory.dist, "get_rank", lambda: 3)
    report = memory_report(program)
    assert report.rank == 3 and format_memory(report).startswith("rank 3:")
