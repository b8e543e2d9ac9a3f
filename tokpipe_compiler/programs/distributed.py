"""One process per stage: rank r runs stage r of every chunk and passes its boundary values
to the ranks that read them. Every rank returns the full output (broadcast from the rank
that computes it), bit for bit what the in-process runtime returns."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.passes.split import prelude_for
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.programs.pipelined import PipelinedProgram, Session, output_blocks
from tokpipe_compiler.runtime.chunking import assemble
from tokpipe_compiler.runtime.transport import DistributedTransport, init_process_group_from_env


def distributed_world() -> tuple[int, int] | None:
    """(rank, world size) when torch.distributed runs more than one process, else None.
    Under torchrun (WORLD_SIZE > 1 in the environment) the process group is started here
    if the script did not: NCCL when CUDA is available, gloo otherwise."""
    if not dist.is_available():
        return None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_process_group_from_env()
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


class DistributedProgram(PipelinedProgram):
    """The per-call program on one rank of a `stages`-process group."""

    def __init__(self, plan: Plan, session: Session | None = None, owner: int | None = None):
        super().__init__(plan, session, owner)
        self.rank, world = distributed_world()
        stages = len(plan.stages)
        if world != stages:
            raise TokpipeError(
                f"stages={stages} but torch.distributed runs {world} processes; launch one "
                f"process per stage (torchrun --nproc-per-node {stages}) or set stages={world}"
            )
        self.world = world
        self.cache_specs = plan.stages[self.rank].caches  # this rank's layers only
        self.transport = DistributedTransport(timeout=plan.config.timeout)
        graph = plan.graphs.stages[self.rank]
        self.prelude = prelude_for(plan.graphs, {self.rank})
        self.reads = {i.name for i in graph.inputs} | {i.source for i in graph.inputs}
        self.on_device: dict[int, torch.Tensor] = {}  # this stage's weights, moved once

    def _call_env(self, args: tuple) -> dict:
        """Per-call values; on a GPU, what this rank's stage reads moves to its device (its
        parameters once: a rank holds only its own stage's weights there)."""
        env = super()._call_env(args)
        if self.device.type == "cpu":
            return env
        for name in self.reads & env.keys():
            value = env[name]
            if isinstance(value, torch.Tensor) and value.device != self.device:
                env[name] = self._moved(value)
        return env

    def _moved(self, value: torch.Tensor) -> torch.Tensor:
        if isinstance(value, torch.nn.Parameter):
            if id(value) not in self.on_device:
                self.on_device[id(value)] = value.detach().to(self.device)
            return self.on_device[id(value)]
        return value.to(self.device, non_blocking=True)

    def _device(self, args: tuple) -> torch.device:
        return self.device

    @property
    def param_bytes(self) -> int:
        """Bytes of the weights this rank holds on its device (its stage's and its prelude
        part's; the rest of the model stays wherever the caller keeps it): the plan's count."""
        return self.plan.stages[self.rank].param_bytes

    def _gather(self, spec, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The producer concatenates its chunks; every rank receives the whole output."""
        if spec.producer == self.rank:
            tensor = assemble(pieces, spec.axis, output_blocks(self.plan, spec)).contiguous()
        else:
            tensor = self._empty_like_output(spec)
        dist.broadcast(tensor, src=spec.producer)
        return tensor

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


def make_program(plan: Plan, session: Session | None, owner: int | None = None) -> Any:
    """The in-process program, or this rank's part when torch.distributed is running.
    `owner`: the id of the weight that tells which model the program runs."""
    if distributed_world() is not None:
        return DistributedProgram(plan, session, owner)
    return PipelinedProgram(plan, session, owner)
