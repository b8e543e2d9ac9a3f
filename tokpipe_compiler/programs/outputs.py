"""A program's token outputs, joined from their chunks' pieces with the layout the traced
graph gives them."""

from __future__ import annotations

import torch

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.stage_graph import OutputKind
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.chunking import Chunk, assemble


def assemble_output(plan: Plan, spec, pieces: list[torch.Tensor],
                    chunks: list[Chunk]) -> torch.Tensor:
    """A token output from its chunks' pieces, with the layout its stage gives it."""
    info = plan.graphs.stages[spec.producer].output_infos[spec.source]
    return assemble(pieces, spec.axis, info.outer, info.lead, info.trail,
                    [c.segments for c in chunks])


def traced_strides(plan: Plan) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each token output's shape and strides as the traced graph gives it. Joined from
    chunks, an output is contiguous; where the model's is not (a transposed patch
    embedding), the graph after a graph break, which Dynamo guards on its inputs' strides,
    would be traced again at the first chunked step."""
    found = {}
    for spec in plan.graphs.outputs:
        if spec.kind != OutputKind.TOKEN:
            continue
        stage = plan.graphs.stages[spec.producer].gm
        value = example_value(next((n for n in stage.graph.nodes if n.name == spec.source),
                                   None))
        if isinstance(value, torch.Tensor):
            found[spec.source] = (tuple(value.shape), tuple(value.stride()))
    return found


def restrided(tensor: torch.Tensor, traced: tuple | None) -> torch.Tensor:
    """`tensor` with the traced strides (`traced_strides`), copied only where they differ."""
    if traced is None or tuple(tensor.shape) != traced[0] or tensor.stride() == traced[1]:
        return tensor
    return torch.empty_strided(tensor.shape, traced[1], dtype=tensor.dtype,
                               device=tensor.device).copy_(tensor)
