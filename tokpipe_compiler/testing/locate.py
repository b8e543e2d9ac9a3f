"""Where a pipelined run first goes wrong: the first (chunk, stage) whose outputs differ
from the same values of an unchunked run of the same stages on the same input.

    chunked:    stage 0 on rows [0,2) -> x_2[0:2]   stage 1 on rows [0,2) -> out[0:2]  ...
    unchunked:  stage 0 on rows [0,8) -> x_2        stage 1 on rows [0,8) -> out
    compare x_2[0:2] with the unchunked x_2 cut to rows [0,2), and so on, chunk by chunk.

Chunk by chunk, stage by stage is the order data flows in (a chunk reads earlier stages
of itself and, through the K/V caches, earlier chunks), so the first difference met is
where it arose, not where it spread to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_leaves

from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.chunking import Chunk, slice_to_chunk
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram

Record = dict[int, list[tuple[Chunk, dict[str, torch.Tensor]]]]  # stage -> [(chunk, outputs)]


@dataclass(frozen=True)
class Where:
    """The first stage output found to differ: stage, chunk, rows, value, size of error."""

    stage: int
    chunk: int
    start: int  # grid rows [start, stop) of the chunk
    stop: int
    value: str  # the stage output's name in the stage graph
    error: float  # max |chunked - unchunked| on the chunk
    scale: float  # max |unchunked| over the whole value

    def __str__(self) -> str:
        return (f"stage {self.stage}, chunk {self.chunk} (grid rows [{self.start}, "
                f"{self.stop})): its output '{self.value}' differs from the unchunked run by "
                f"{self.error:.3e} (max |value| {self.scale:.3e})")


def locate(plan: Plan, calls: list[tuple], rtol: float) -> Where | None:
    """Replay `calls` (graph inputs, in order) on a fresh program of `plan`, and compare the
    last one stage by stage with an unchunked run of that input. None: no stage differs."""
    program = PipelinedProgram(plan)
    for args in calls[:-1]:
        program(*args)
    chunked = record_stage_outputs(program, calls[-1])
    sync = replace(plan, config=replace(plan.config, mode="sync"))
    whole = record_stage_outputs(PipelinedProgram(sync), calls[-1])
    for chunk, stage, outputs in _chunk_major(chunked):
        for name, value in outputs.items():
            info = plan.graphs.stages[stage].output_infos[name]
            reference = whole[stage][0][1][name]
            expected = reference if info.axis is None or not info.per_unit else \
                slice_to_chunk(reference, info.axis, info.per_unit, chunk, info.outer)
            if value.shape != expected.shape:  # it holds joined tokens (text, a register)
                continue
            error = (value.float() - expected.float()).abs().max().item()
            scale = reference.float().abs().max().item()
            if not error <= rtol * scale:  # also catches NaN
                return Where(stage, chunk.index, chunk.start, chunk.stop, name, error, scale)
    return None


@dataclass(frozen=True)
class Drift:
    """How far a program compiled by `compiler` is from the same program run eagerly."""

    compiler: str
    error: float  # max |compiled - eager| over the last call's outputs
    scale: float  # max |eager| there

    def passes(self, rtol: float) -> bool:
        return self.error <= rtol * self.scale

    def __str__(self) -> str:
        return (f"the same pipelined calls replayed with compiler='eager' differ from the "
                f"{self.compiler}-compiled run by {self.error:.3e} (max |value| "
                f"{self.scale:.3e})")


def compiler_drift(plan: Plan, calls: list[tuple]) -> Drift:
    """Replay `calls` on fresh programs of `plan`, compiled as planned and with
    compiler="eager" (same chunks, same schedule), and compare their last outputs."""
    eager = replace(plan, config=replace(plan.config, compiler="eager"))
    compiled, reference = (_replay(PipelinedProgram(p), calls) for p in (plan, eager))
    pairs = [(c.float(), e.float()) for c, e in zip(compiled, reference, strict=True)
             if e.numel()]
    return Drift(plan.config.compiler,
                 max(((c - e).abs().max().item() for c, e in pairs), default=0.0),
                 max((e.abs().max().item() for _, e in pairs), default=0.0))


def _replay(program: PipelinedProgram, calls: list[tuple]) -> list[torch.Tensor]:
    """The tensors of the last call's output, after replaying every call in order."""
    for args in calls[:-1]:
        program(*args)
    return [x for x in tree_leaves(program(*calls[-1])) if isinstance(x, torch.Tensor)]


def record_stage_outputs(program: PipelinedProgram, args: tuple) -> Record:
    """Run one call of `program`, keeping every stage's outputs per chunk, in order."""
    record: Record = {}
    originals = list(program.stage_programs)

    def recording(index: int, stage):
        def run(chunk: Chunk, inputs: list[torch.Tensor]):
            outputs = stage(chunk, inputs)
            names = program.plan.graphs.stages[index].outputs
            record.setdefault(index, []).append((chunk, dict(zip(names, outputs, strict=True))))
            return outputs

        return run

    program.stage_programs = [recording(i, s) for i, s in enumerate(originals)]
    try:
        program(*args)
    finally:
        program.stage_programs = originals
    return record


def _chunk_major(record: Record) -> list[tuple[Chunk, int, dict[str, torch.Tensor]]]:
    """(chunk, stage, outputs) sorted chunk by chunk, then stage by stage. A stage runs its
    chunks in order, so a run's rows follow from the units of the runs before it (not
    from the chunk it was handed, which is what a bug may have got wrong)."""
    out = []
    for stage, runs in record.items():
        start = 0
        for index, (chunk, outputs) in enumerate(runs):
            out.append((Chunk(index, start, start + chunk.units, chunk.segments), stage,
                        outputs))
            start += chunk.units
    return sorted(out, key=lambda item: (item[0].index, item[1]))
