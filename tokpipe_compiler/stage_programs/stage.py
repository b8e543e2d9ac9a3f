"""A stage as the runtime calls it: specialised and compiled per chunk length (and, where
it carries text segments, per chunk with or without them), on demand, and with
`cuda_graphs` replayed from one CUDA graph per chunk (`runtime/cuda_graphs.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY
from tokpipe_compiler.core.stage_graph import CALL, StageGraph
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.passes.specialize import specialize
from tokpipe_compiler.runtime.branch_exchange import cfg_gather
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.cuda_graphs import COPIED, HOST, PERSISTENT, GraphedStage
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT
from tokpipe_compiler.stage_programs.compile import StageFn, compile_failed, compile_named


class StageProgram:
    """Stage `graph` at every chunk length it is asked for (typically one or two per mode).

    `persistent`: names of the inputs that stay where they are from call to call (weights,
    caches): a CUDA graph reads them in place instead of copying them in.
    """

    def __init__(self, graph: StageGraph, compiler: str, cuda_graphs: bool = False,
                 persistent: frozenset[str] = frozenset()):
        self.graph = graph
        self.compiler = compiler
        self.cuda_graphs = cuda_graphs
        self.persistent = persistent
        self.graphs_refused = False  # warned once that this stage runs without graphs
        # Keyed by (units, segments): the chunk length and whether the chunk computes the
        # text segments (a stage without segments has one form per length).
        self.specialised: dict[tuple[int, bool], torch.fx.GraphModule] = {}
        self.compiled: dict[tuple[int, bool], StageFn] = {}
        self.segmented = any(n.meta.get(META_KEY, INVARIANT_INFO).segmented
                             for n in graph.gm.graph.nodes)
        # The inputs whose strides depend on where they came from: a chunk cut from a
        # full tensor, or received or carried whole. Per-call values keep theirs from call
        # to call (Dynamo guards the arguments' strides; the prelude computes the rest).
        self.per_chunk = [i for i, spec in enumerate(graph.inputs) if spec.kind != CALL]

    def form(self, units: int, segments: bool = True) -> tuple[int, bool]:
        """The (units, segments) form a chunk runs as: one per length without segments."""
        return units, segments or not self.segmented

    def graph_for(self, units: int, segments: bool = True) -> torch.fx.GraphModule:
        key = self.form(units, segments)
        if key not in self.specialised:
            self.specialised[key] = specialize(self.graph.gm, *key)
        return self.specialised[key]

    def __call__(self, chunk: Chunk, inputs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        if self.compiler != "eager":
            # Compiled code is specialised to its inputs' strides (and checks them). K/V
            # caches are contiguous, and passed as themselves: they are written in place.
            for i in self.per_chunk:
                if isinstance(inputs[i], torch.Tensor):
                    inputs[i] = inputs[i].contiguous()
        key = self.form(chunk.units, chunk.segments)
        if key not in self.compiled:
            what = f"stage {self.graph.index}'s graph for chunks of {key[0]} token rows"
            graph = self.graph_for(*key)  # its refusals are tokpipe's, not Inductor's
            try:
                fn = compile_named(what, graph, inputs, self.compiler)
            except Exception as err:  # Inductor's own failure: name what it compiled
                raise compile_failed(what, self.compiler, err) from err
            self.compiled[key] = self._graphed(fn, inputs) if self.cuda_graphs else fn
        with torch.no_grad():
            return self.compiled[key](*inputs)

    def _graphed(self, fn: StageFn, inputs: list) -> StageFn:
        """`fn` behind CUDA graphs, or `fn` itself (with a warning) where they cannot run."""
        name = str(self.graph.index)
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)
                       and x.device.type != "cpu"), None)
        if device is None or device.type != "cuda":
            reason = "its inputs are not on a CUDA device"
        elif any(n.target is cfg_gather for n in self.graph.gm.graph.nodes):
            reason = "it exchanges guidance branches with another rank inside the stage"
        else:
            return GraphedStage(fn, self.input_kinds(), name)
        if not self.graphs_refused:
            warn(f"tokpipe: cuda_graphs: stage {name} runs without CUDA graphs "
                 f"({reason})")
        self.graphs_refused = True
        return fn

    def input_kinds(self) -> list[str]:
        """How each input reaches a graph: the chunk descriptor as host values, weights
        and caches in place, everything else copied in."""
        return [HOST if spec.name == CHUNK_INPUT else
                PERSISTENT if spec.name in self.persistent else COPIED
                for spec in self.graph.inputs]
