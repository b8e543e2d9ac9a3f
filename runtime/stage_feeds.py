"""What the runtime hands a stage per chunk: its input list, most of it per call (weights,
caches, conditioning) and a few entries per chunk (boundary values, inputs cut to the
chunk, the chunk's descriptor)."""

from __future__ import annotations

import torch

from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.core.stage_graph import BOUNDARY, CALL, SLICED, StageGraph
from tokpipe_compiler.runtime.chunking import Chunk, slice_to_chunk
from tokpipe_compiler.runtime.kv_attention import (
    CHUNK_INPUT,
    CHUNK_START,
    CHUNK_UNITS,
    CHUNK_VISIBLE,
)


def chunk_descriptor(chunk: Chunk, visible: int) -> torch.Tensor:
    descriptor = torch.empty(3, dtype=torch.long)
    descriptor[CHUNK_START], descriptor[CHUNK_UNITS] = chunk.start, chunk.units
    descriptor[CHUNK_VISIBLE] = visible
    return descriptor


def input_blocks(stage: StageGraph) -> dict[str, int]:
    """Outer blocks of each placeholder whose token axis has more than one (the TokenInfo
    the split pass copied onto it): a sliced input is cut in every block."""
    infos = {n.name: n.meta.get(META_KEY) for n in stage.gm.graph.nodes if n.op == "placeholder"}
    return {name: info.outer for name, info in infos.items()
            if info is not None and info.outer > 1}


class StageFeeds:
    """How each stage's input list is filled, worked out once per program, not per chunk.

    A stage reads hundreds of per-call values (its weights, caches, conditioning) and a
    few per-chunk ones (boundary values, inputs cut to the chunk, the chunk descriptor).
    The per-call part of the list is built once per step's values and copied for each
    chunk; only the per-chunk positions are filled per chunk. Chunk descriptors are made
    once per (chunk, visible) and reused (nothing writes to them).
    """

    def __init__(self, stages: list[StageGraph]):
        self._per_chunk = []  # per stage: (position, input spec, outer blocks)
        self._per_call = []  # per stage: (position, name of the per-call value)
        for stage in stages:
            outer = input_blocks(stage)
            self._per_chunk.append([(i, spec, outer.get(spec.name, 1))
                                    for i, spec in enumerate(stage.inputs)
                                    if spec.kind != CALL or spec.name == CHUNK_INPUT])
            self._per_call.append([(i, spec.name) for i, spec in enumerate(stage.inputs)
                                   if spec.kind == CALL and spec.name != CHUNK_INPUT])
        self._sizes = [len(stage.inputs) for stage in stages]
        self._templates: dict[int, tuple[dict, list]] = {}  # stage -> (env, its list)
        self._descriptors: dict[tuple[int, int, int], torch.Tensor] = {}

    def inputs(self, stage: int, chunk: Chunk, visible: int, env: dict,
               chunk_values: dict) -> list:
        """Stage `stage`'s inputs for `chunk`: per-call values from `env`, the rest from
        the chunk's values (computed, received or carried) or cut from `env`."""
        cached = self._templates.get(stage)
        if cached is None or cached[0] is not env:
            template = [None] * self._sizes[stage]
            for i, name in self._per_call[stage]:
                template[i] = env[name]
            cached = self._templates[stage] = (env, template)
        inputs = cached[1].copy()
        for i, spec, outer in self._per_chunk[stage]:
            if spec.kind == BOUNDARY or spec.name in chunk_values:
                inputs[i] = chunk_values[spec.name]
            elif spec.kind == SLICED:
                inputs[i] = slice_to_chunk(env[spec.source], spec.axis, spec.per_unit,
                                           chunk, outer)
            else:
                inputs[i] = self.descriptor(chunk, visible)
        return inputs

    def forget(self) -> None:
        """Drops the per-call values gathered for the last step."""
        self._templates.clear()

    def descriptor(self, chunk: Chunk, visible: int) -> torch.Tensor:
        key = (chunk.start, chunk.units, visible)
        if key not in self._descriptors:
            self._descriptors[key] = chunk_descriptor(chunk, visible)
        return self._descriptors[key]
