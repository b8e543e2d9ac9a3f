"""One process per stage: rank r runs stage r of every chunk and passes its boundary values
to the ranks that read them. Every rank returns the full output (broadcast from the rank
that computes it), bit for bit what the in-process runtime returns."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.runtime.caches import KVCaches
from tokpipe_compiler.runtime.executor import Executor
from tokpipe_compiler.runtime.schedule import build_schedule
from tokpipe_compiler.runtime.transport import DistributedTransport

from .errors import TokpipeError
from .graph_utils import example_value
from .plan import Plan
from .program import PipelinedProgram, Session


def distributed_world() -> tuple[int, int] | None:
    """(rank, world size) when torch.distributed runs more than one process, else None."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


class DistributedProgram(PipelinedProgram):
    """The per-call program on one rank of a `stages`-process group."""

    def __init__(self, plan: Plan, session: Session | None = None):
        super().__init__(plan, session)
        self.rank, world = distributed_world()
        stages = len(plan.stages)
        if world != stages:
            raise TokpipeError(
                f"stages={stages} but torch.distributed runs {world} processes; launch one "
                f"process per stage (torchrun --nproc-per-node {stages}) or set stages={world}"
            )
        self.caches = KVCaches(plan.stages[self.rank].caches)
        self.transport = DistributedTransport(timeout=plan.config.timeout)
        self.chunked_actions = build_schedule(stages, len(plan.chunks), world=stages,
                                              consumers=plan.consumers).ranks[self.rank]
        self.sync_actions = build_schedule(stages, 1, world=stages,
                                           consumers=plan.consumers).ranks[self.rank]

    def _run(self, call_env: dict, chunks) -> dict:
        actions = self.sync_actions if len(chunks) == 1 else self.chunked_actions
        executor = Executor(self.plan.graphs.stages, self._run_stage, rank=self.rank,
                            transport=self.transport, timeline=self.timeline)
        values = executor.run(actions, chunks, call_env, self._visible(chunks), step=self.calls)
        self.transport.flush()
        return values

    def _assemble(self, values: dict, chunks, call_env: dict) -> tuple:
        out = []
        for spec in self.plan.graphs.outputs:
            if spec.kind != "token":
                out.append(spec.source if spec.kind == "const" else call_env[spec.source])
                continue
            if spec.producer == self.rank:
                pieces = [values[c.index][spec.source] for c in chunks]
                tensor = torch.cat(pieces, spec.axis).contiguous()
            else:
                tensor = self._empty_like_output(spec)
            dist.broadcast(tensor, src=spec.producer)
            out.append(tensor)
        return tuple(out)

    def _empty_like_output(self, spec) -> torch.Tensor:
        stage = self.plan.graphs.stages[spec.producer]
        node = next(n for n in stage.gm.graph.nodes if n.name == spec.source)
        value = example_value(node)
        return torch.empty(value.shape, dtype=value.dtype, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.transport.device

    def close(self) -> None:
        self.transport.close()


def make_program(plan: Plan, session: Session | None) -> Any:
    """The in-process program, or this rank's part when torch.distributed is running."""
    if distributed_world() is not None:
        return DistributedProgram(plan, session)
    return PipelinedProgram(plan, session)
