"""The callable a Dynamo graph becomes: one call = one denoising step through the pipeline.

Generations: the first `warmup_steps` calls after a reset run the whole sequence stage after
stage (exact) and fill the K/V caches; later calls run chunk by chunk with the mode's
semantics. A program whose role (its token input) was last served by another program with
other shapes starts a new generation by itself.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tokpipe_compiler.runtime.caches import KVCaches
from tokpipe_compiler.runtime.chunking import Chunk, chunk_table
from tokpipe_compiler.runtime.executor import Executor, Timeline
from tokpipe_compiler.runtime.schedule import build_schedule

from .plan import Plan
from .stage import StageProgram


class Session:
    """The programs of one compiled model (one torch.compile call), for reset()."""

    def __init__(self) -> None:
        self.programs: weakref.WeakSet[PipelinedProgram] = weakref.WeakSet()
        self.last_by_role: dict[str, PipelinedProgram] = {}

    def reset(self) -> None:
        for program in list(self.programs):
            program.reset()
        self.last_by_role.clear()

    def claim(self, program: PipelinedProgram) -> None:
        """Called per call: a program taking over its role from another starts afresh."""
        role = program.plan.token_input
        if self.last_by_role.get(role) is not program:
            program.reset()
            self.last_by_role[role] = program


class PipelinedProgram:
    """Runs a Plan in one process: every stage, on the same chunk schedule as the ranks."""

    def __init__(self, plan: Plan, session: Session | None = None):
        self.plan = plan
        self.session = session
        self.stage_programs = [StageProgram(g, plan.config.compiler) for g in plan.graphs.stages]
        self.caches = KVCaches(plan.caches)
        self.calls = 0
        self.timeline = Timeline()
        self.whole = chunk_table(plan.units, 1)
        self.sync_schedule = build_schedule(len(plan.stages), 1, consumers=plan.consumers)
        if session is not None:
            session.programs.add(self)

    def reset(self) -> None:
        self.caches.reset()
        self.calls = 0

    def __call__(self, *args: torch.Tensor) -> Any:
        if self.session is not None:
            self.session.claim(self)
        with torch.no_grad():
            call_env = self._call_env(args)
            chunks = self._step_chunks()
            values = self._run(call_env, chunks)
            outputs = self._assemble(values, chunks, call_env)
        self.calls += 1
        self.caches.filled = True  # every chunk has written its K/V once
        return outputs

    def _step_chunks(self) -> list[Chunk]:
        """The whole sequence as one chunk (sync mode, warmup calls), or the chunk table."""
        mode = self.plan.config.mode
        warm = mode == "stale" and self.calls < self.plan.config.warmup_steps
        return self.whole if mode == "sync" or warm else self.plan.chunks

    def _run(self, call_env: dict, chunks: list[Chunk]) -> dict:
        schedule = self.sync_schedule if len(chunks) == 1 else self.plan.schedule
        executor = Executor(self.plan.graphs.stages, self._run_stage, timeline=self.timeline)
        return executor.run(schedule.ranks[0], chunks, call_env, self._visible(chunks),
                            step=self.calls)

    def _visible(self, chunks: list[Chunk]):
        """Cache units a chunk may attend to: the whole cache once it holds a full step
        (stale), else what this call has written so far (causal, or a first call)."""
        units = self.plan.units
        full = self.plan.config.mode == "stale" and self.caches.filled

        def visible(chunk: Chunk) -> int:
            return units if full or len(chunks) == 1 else chunk.stop

        return visible

    def _call_env(self, args: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        graphs = self.plan.graphs
        env = dict(zip(graphs.input_names, args, strict=True))
        prelude_values = graphs.prelude(*args)
        env.update(zip(graphs.prelude_outputs, prelude_values, strict=True))
        device = _device_of(args)
        env.update(self.caches.tensors(device))
        return env

    def _run_stage(self, stage: int, units: int, inputs: list[torch.Tensor]):
        return self.stage_programs[stage](units, inputs)

    def _assemble(self, values: dict, chunks: list[Chunk], call_env: dict) -> tuple:
        out = []
        for spec in self.plan.graphs.outputs:
            if spec.kind == "const":
                out.append(spec.source)
            elif spec.kind == "token":
                pieces = [values[c.index][spec.source] for c in chunks]
                out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, spec.axis))
            else:
                out.append(call_env[spec.source])
        return tuple(out)


def _device_of(args: tuple) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")
