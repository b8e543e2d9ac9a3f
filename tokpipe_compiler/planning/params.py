"""Which weights each rank holds: counted once, here, for the plan and the programs.

A rank holds its stage's parameters and buffers, and those of the part of the prelude it
runs (`prelude_for`): the per-block modulation and conditioning weights whose outputs its
stage reads. Weights the prelude of several ranks reads (the timestep embedding) are held
by each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from tokpipe_compiler.core.fx import example_value, is_parameter
from tokpipe_compiler.core.stage_graph import CALL, SLICED, SplitGraphs, StageGraph
from tokpipe_compiler.core.tensor_bytes import storage_bytes
from tokpipe_compiler.passes.split import prelude_part


@dataclass(frozen=True)
class Held:
    """Bytes of the weights one rank holds."""

    total: int  # its stage's weights and its prelude's, each counted once
    prelude: int  # of which its stage does not read itself: the conditioning it computes


def bytes_by_name(graphs: SplitGraphs) -> dict[str, int]:
    """Bytes of every parameter or buffer input of the traced graph, by input name."""
    out = {}
    for node in graphs.prelude.graph.nodes:
        value = example_value(node)
        if node.op == "placeholder" and is_parameter(node) and value is not None:
            out[node.name] = storage_bytes(value)
    return out


def held_by_stage(graphs: SplitGraphs) -> list[Held]:
    """What the rank of each stage holds (one rank per stage)."""
    sizes = bytes_by_name(graphs)
    out = []
    for stage in graphs.stages:
        own = stage_reads(stage) & sizes.keys()
        held = own | prelude_reads(graphs, {stage.index}) & sizes.keys()
        out.append(Held(sum(sizes[n] for n in held), sum(sizes[n] for n in held - own)))
    return out


def prelude_only_bytes(graphs: SplitGraphs) -> int:
    """Weights that only the prelude reads, each counted once."""
    sizes = bytes_by_name(graphs)
    staged = {n for stage in graphs.stages for n in stage_reads(stage)}
    return sum(b for name, b in sizes.items() if name in computes_from(graphs.prelude) - staged)


def stage_reads(stage: StageGraph) -> set[str]:
    """Per-call values a stage reads whole (CALL) or cut to the chunk from a table (SLICED);
    its rank holds either whole."""
    return {i.name for i in stage.inputs if i.kind == CALL} | {
        i.source for i in stage.inputs if i.kind == SLICED}


def prelude_reads(graphs: SplitGraphs, stages: set[int]) -> set[str]:
    """Inputs the prelude part that `stages` read computes from (found without building
    it: a full-depth model's prelude has thousands of nodes)."""
    live = prelude_part(graphs, stages)[0]
    return {n.name for n in live
            if n.op == "placeholder" and any(u in live and u.op != "output" for u in n.users)}


def computes_from(gm: torch.fx.GraphModule) -> set[str]:
    """Inputs a graph computes with (not those it only passes on to its output)."""
    return {n.name for n in gm.graph.nodes
            if n.op == "placeholder" and any(u.op != "output" for u in n.users)}
