"""What a rank holds, predicted by the plan and measured on the running program.

    from tokpipe_compiler.inspection.memory import memory_report, format_memory
    print(format_memory(memory_report(tp.programs(compiled)[0])))

Per stage this process runs: the weights its rank holds (the stage's and its share of the
prelude), its K/V caches (one set per guidance branch), and the process's peak memory
(CUDA: the allocator's peak on the device; CPU: the resident set's high-water mark).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokpipe_compiler.inspection.report import human_bytes
from tokpipe_compiler.runtime.caches import held_bytes


@dataclass(frozen=True)
class StageMemory:
    stage: int
    weights_predicted: int
    kv_predicted: int  # one guidance branch
    kv_measured: int  # every branch held now (or, released, when the generation ended)
    branches: int


@dataclass(frozen=True)
class MemoryReport:
    rank: int  # the process's rank in the world
    stages: list[StageMemory]
    peak: int  # bytes, the process's (see peak_bytes)
    peak_source: str
    released: bool = False  # the K/V buffers were freed as the generation ended (a ring's)


def memory_report(program) -> MemoryReport:
    """Predicted and measured bytes of the stages `program` runs (all of them in process,
    its own stage on a rank)."""
    plan = program.plan
    mine = range(len(plan.stages)) if program.world == 1 else [program.rank]
    released = program.released if not program.branches else None
    held, branches = ((released.held, released.branches) if released else
                      (held_bytes(program.branches), len(program.branches)))
    rows = []
    for index in mine:
        stage = plan.stages[index]
        names = {n for spec in stage.caches for n in spec.names}
        rows.append(StageMemory(index, stage.param_bytes, stage.kv_cache_bytes,
                                sum(held.get(name, 0) for name in names), branches))
    peak, source = peak_bytes(released.device if released else _device(program))
    return MemoryReport(_process_rank(program), rows, peak, source, released is not None)


def _process_rank(program) -> int:
    """The process's rank in the world: a hybrid cfg=2 ring's program counts its rank in
    its guidance branch's group, which names two processes alike."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return program.rank


def peak_bytes(device: torch.device) -> tuple[int, str]:
    """The process's peak: CUDA's allocator on a GPU, else the resident set's maximum."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocator peak"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss * scale, "process max RSS"


def _device(program) -> torch.device:
    for caches in program.branches.values():
        for tensor in caches.buffers.values():
            return tensor.device
    return torch.device("cpu")


def format_memory(report: MemoryReport) -> str:
    lines = [f"rank {report.rank}: peak {human_bytes(report.peak)} ({report.peak_source})"
             + ("; K/V held until the generation ended, then freed" if report.released else ""),
             "stage  weights held  K/V predicted (per branch)  K/V held  branches"]
    for s in report.stages:
        lines.append(f"{s.stage:>5}  {human_bytes(s.weights_predicted):>12}  "
                     f"{human_bytes(s.kv_predicted):>26}  {human_bytes(s.kv_measured):>8}  "
                     f"{s.branches:>8}")
    return "\n".join(lines)
