"""The executor: a small interpreter over one rank's schedule, recording what ran when.

It knows nothing of graphs: a stage is a function from its inputs to its outputs, and the
wiring (which value each stage reads, from where) comes from the split pass's StageInputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tokpipe_compiler.passes.split import BOUNDARY, SLICED, StageGraph

from .chunking import Chunk, slice_to_chunk
from .kv_attention import CHUNK_START, CHUNK_UNITS, CHUNK_VISIBLE
from .schedule import COMPUTE, RECV, SEND, Action

StageRunner = Callable[[int, int, list[torch.Tensor]], Sequence[torch.Tensor]]
CHUNK_INPUT = "tokpipe_chunk"


@dataclass
class Event:
    """One thing a rank did: compute, send, recv or wait."""

    kind: str
    rank: int
    stage: int
    chunk: int
    step: int
    start: float
    duration: float
    units: int | None = None  # grid rows of the chunk (tells warmup calls from chunked ones)


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def record(self, kind: str, rank: int, action: Action, start: float,
               units: int | None = None) -> None:
        self.events.append(Event(kind, rank, action.stage, action.chunk, action.step, start,
                                 time.perf_counter() - start, units))


class Executor:
    """Runs one rank's actions for one call.

    call_env: per-call values by name (user inputs, prelude outputs, K/V caches).
    visible(chunk): cache units the chunk may attend to (the mode's semantics).
    transport: moves BOUNDARY values between ranks (None when every stage is local).
    """

    def __init__(self, stages: list[StageGraph], run_stage: StageRunner, rank: int = 0,
                 transport=None, timeline: Timeline | None = None):
        self.stages = stages
        self.run_stage = run_stage
        self.rank = rank
        self.transport = transport
        self.timeline = timeline if timeline is not None else Timeline()

    def run(self, actions: Sequence[Action], chunks: Sequence[Chunk], call_env: dict,
            visible: Callable[[Chunk], int]) -> dict[int, dict[str, torch.Tensor]]:
        """Returns, per chunk index, every value this rank computed or received."""
        values: dict[int, dict[str, torch.Tensor]] = {c.index: {} for c in chunks}
        for action in actions:
            start = time.perf_counter()
            chunk = chunks[action.chunk]
            if action.kind == COMPUTE:
                self._compute(action, chunk, call_env, values[chunk.index], visible(chunk))
                self.timeline.record("compute", self.rank, action, start, chunk.units)
            elif action.kind == SEND:
                self._send(action, values[chunk.index])
                self.timeline.record("send", self.rank, action, start)
            elif action.kind == RECV:
                self._recv(action, values[chunk.index])
                self.timeline.record("recv", self.rank, action, start)
        return values

    def _compute(self, action: Action, chunk: Chunk, call_env: dict,
                 chunk_values: dict[str, torch.Tensor], visible: int) -> None:
        stage = self.stages[action.stage]
        call_env[CHUNK_INPUT] = chunk_descriptor(chunk, visible)
        inputs = [stage_input(i, chunk, call_env, chunk_values) for i in stage.inputs]
        outputs = self.run_stage(action.stage, chunk.units, inputs)
        chunk_values.update(zip(stage.outputs, outputs, strict=True))

    def _send(self, action: Action, chunk_values: dict[str, torch.Tensor]) -> None:
        for name in boundary_names(self.stages, action.stage, action.peer):
            self.transport.send(action, name, chunk_values[name], action.peer)

    def _recv(self, action: Action, chunk_values: dict[str, torch.Tensor]) -> None:
        for name in boundary_names(self.stages, action.stage, self.rank):
            chunk_values[name] = self.transport.recv(action, name, action.peer)


def chunk_descriptor(chunk: Chunk, visible: int) -> torch.Tensor:
    descriptor = torch.empty(3, dtype=torch.long)
    descriptor[CHUNK_START], descriptor[CHUNK_UNITS] = chunk.start, chunk.units
    descriptor[CHUNK_VISIBLE] = visible
    return descriptor


def stage_input(spec, chunk: Chunk, call_env: dict, chunk_values: dict) -> torch.Tensor:
    if spec.kind == BOUNDARY:
        return chunk_values[spec.name]
    if spec.kind == SLICED:
        return slice_to_chunk(call_env[spec.source], spec.axis, spec.per_unit, chunk)
    return call_env[spec.name]


def boundary_names(stages: list[StageGraph], producer: int, consumer_stage: int) -> list[str]:
    """Values of `producer` that stage `consumer_stage` reads, in a fixed order."""
    wanted = {i.name for i in stages[consumer_stage].inputs
              if i.kind == BOUNDARY and i.producer == producer}
    return [name for name in stages[producer].outputs if name in wanted]
