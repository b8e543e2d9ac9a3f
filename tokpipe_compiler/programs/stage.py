"""A stage as the runtime calls it: specialised and compiled per chunk length, on demand."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokpipe_compiler.core.stage_graph import StageGraph
from tokpipe_compiler.passes.specialize import specialize
from tokpipe_compiler.programs.compile import StageFn, compile_stage


class StageProgram:
    """Stage `graph` at every chunk length it is asked for (typically one or two per mode)."""

    def __init__(self, graph: StageGraph, compiler: str):
        self.graph = graph
        self.compiler = compiler
        self.specialised: dict[int, torch.fx.GraphModule] = {}
        self.compiled: dict[int, StageFn] = {}

    def graph_for(self, units: int) -> torch.fx.GraphModule:
        if units not in self.specialised:
            self.specialised[units] = specialize(self.graph.gm, units)
        return self.specialised[units]

    def __call__(self, units: int, inputs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        if self.compiler == "inductor":
            # Compiled code is specialised to its inputs' strides; a chunk cut from a full
            # tensor and one received or carried whole differ. (K/V caches are contiguous,
            # so they are passed as themselves and written in place.)
            inputs = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs]
        if units not in self.compiled:
            self.compiled[units] = compile_stage(self.graph_for(units), inputs, self.compiler)
        with torch.no_grad():
            return self.compiled[units](*inputs)
