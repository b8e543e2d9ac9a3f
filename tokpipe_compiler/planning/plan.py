"""The Plan: what the compiler made (stages, their graphs and costs, chunks, schedule).

`print(plan)` is a readable summary, `plan.summary()` the same numbers as a dict (what
`plan.save(folder)` writes to plan.json, with the stage graphs and charts beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.fx import example_value, module_path, node_count
from tokpipe_compiler.core.stage_graph import BOUNDARY, SplitGraphs, StageGraph
from tokpipe_compiler.costmodel import pipeline_time
from tokpipe_compiler.costmodel.cost import Cost, graph_cost
from tokpipe_compiler.passes.partition import Partition
from tokpipe_compiler.planning import params
from tokpipe_compiler.planning.layers import compress_layers, layer_of
from tokpipe_compiler.runtime.caches import AnyCacheSpec
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.schedule import Schedule, build_schedule

RING_STEPS = 20  # steps of the PipeFusion ring whose bubble the summary predicts


@dataclass
class StagePlan:
    index: int
    graph: StageGraph
    modules: list[str]  # module paths whose nodes run in this stage, in order
    node_count: int
    # Weights (parameters and buffers) its rank holds: the stage's own and those of the
    # prelude part the rank runs, shared conditioning weights counted on every rank.
    param_bytes: int
    prelude_param_bytes: int  # of param_bytes: the prelude's (modulation, conditioning)
    cost: Cost  # one chunk of N tokens over C tokens of context (passes/cost.py)
    send_bytes_per_unit: int  # bytes to later stages per token-grid unit
    caches: list[AnyCacheSpec] = field(default_factory=list)
    # bytes of joint attention's text rows sent, once, by a chunk that computes the text
    send_text_bytes: int = 0
    layer_flops: list[tuple[str, float]] = field(default_factory=list)  # partition's weights

    @property
    def code(self) -> str:
        """The stage graph as Python, with each value's shape and the model's source line:
        the whole sequence's shapes (each chunk runs the graph at its own length)."""
        return self.graph.gm.print_readable(print_output=False)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.bytes for c in self.caches)

    @property
    def layers(self) -> list[str]:
        """Layers ('blocks.0-3', 'embed') this stage runs, compressed."""
        return compress_layers([layer_of(m) for m in self.modules])


@dataclass
class Plan:
    config: Config
    graphs: SplitGraphs
    stages: list[StagePlan]
    chunks: list[Chunk]
    units: int  # rows of the token grid
    token_input: str
    caches: list[AnyCacheSpec]
    consumers: dict[int, set[int]]
    tokens: int = 0  # image (video) tokens of one sample, text segments not counted
    imbalance: float = 1.0  # the slowest stage's cost over an even share (the partition's)
    imbalance_warning: str = ""  # why the stages are not balanced, when they are not
    tail_ops: tuple[str, ...] = ()  # ops mixing tokens that end the graph: run after it
    _schedules: dict[tuple, Schedule] = field(default_factory=dict, init=False, repr=False,
                                              compare=False)

    # ---- numbers ---------------------------------------------------------------------

    def chunk_tokens(self, chunk: Chunk) -> int:
        return chunk.units * self.tokens // self.units

    def context_tokens(self, chunk: Chunk) -> int:
        """Image tokens a chunk attends over: earlier ones (causal) or the whole sequence;
        joint attention's text (`text_tokens`) comes on top."""
        if self.config.mode == "causal":
            return chunk.stop * self.tokens // self.units
        return self.tokens

    @property
    def text_tokens(self) -> int:
        """Tokens outside the chunked ones (one sample's): joint attention's text, or a
        class or register token joined to the image's, which every chunk's context holds
        besides its image tokens; 0 where there are none."""
        return max((s.cost.text_rows for s in self.stages), default=0)

    def stage_flops(self, stage: int, chunk: Chunk) -> float:
        cost = self.stages[stage].cost
        return cost.at(self.chunk_tokens(chunk), self.context_tokens(chunk), 0,
                       float(chunk.segments))[0]

    def send_bytes(self, stage: int, chunk: Chunk) -> int:
        """Bytes stage `stage` sends to later stages for `chunk`, its text rows included
        where the chunk computes them."""
        sends = self.stages[stage]
        return sends.send_bytes_per_unit * chunk.units + sends.send_text_bytes * chunk.segments

    @property
    def model_param_bytes(self) -> int:
        """Parameters and buffers the traced graph reads (each counted once)."""
        return sum(params.bytes_by_name(self.graphs).values())

    @property
    def prelude_param_bytes(self) -> int:
        """Weights only the prelude reads (timestep, per-block modulation, text
        conditioning), each counted once; every rank holds those its prelude part reads."""
        return params.prelude_only_bytes(self.graphs)

    def prelude_flops(self) -> float:
        nodes = [n for n in self.graphs.prelude.graph.nodes
                 if n.op not in ("placeholder", "output")]
        return graph_cost(nodes, max(self.tokens, 1)).at(0, 0)[0]

    def schedule(self, chunks: int | None = None, steps: int = 1, world: int = 1,
                 carries: dict[int, set[int]] | None = None) -> Schedule:
        """The checked schedule of `steps` steps of `chunks` chunks (default: the plan's) on
        `world` ranks (1, or one per stage); `carries`: ring edges. Built once per layout:
        programs, the printed plan and the charts all read this one."""
        chunks = len(self.chunks) if chunks is None else chunks
        edges = tuple(sorted((s, tuple(sorted(d))) for s, d in (carries or {}).items()))
        key = (chunks, steps, world, edges)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                len(self.stages), chunks, world=world, steps=steps, consumers=self.consumers,
                carries={s: set(d) for s, d in edges})
        return self._schedules[key]

    def distributed_schedule(self, steps: int = 1) -> Schedule:
        """What the ranks run when rank r holds stage r."""
        return self.schedule(steps=steps, world=len(self.stages))

    def chunk_flops(self) -> list[list[float]]:
        """FLOPs of each chunk on each stage: [stage][chunk]."""
        return [[self.stage_flops(s.index, c) for c in self.chunks] for s in self.stages]

    def predicted_boxes(self, steps: int = 1, ring: bool = False,
                        times: list[list[float]] | None = None) -> list[pipeline_time.Box]:
        """When each rank computes what (`pipeline_time` over this plan's one-rank-per-stage
        schedule), with `times[stage][chunk]` (default: FLOPs) and free links."""
        world = len(self.stages)
        return pipeline_time.boxes(
            self.chunk_flops() if times is None else times, steps, ring,
            schedule_for=lambda k, carries: self.schedule(steps=k, world=world, carries=carries))

    def bubble_fraction(self, steps: int = 1) -> float:
        """Predicted idle share of the devices from stage FLOPs per chunk: steps=1 is one
        call that fills and drains the pipeline ((S-1)/(M+S-1) for balanced stages); more
        steps run as a PipeFusion ring, whose only bubble is the first fill and stage
        imbalance (and, with fewer chunks than stages, waiting for chunks to come round)."""
        flops = self.chunk_flops()
        boxes = self.predicted_boxes(steps, ring=steps > 1, times=flops)
        total = max((b.end for b in boxes), default=0.0)
        busy = steps * sum(map(sum, flops))
        return 1 - busy / (len(self.stages) * total) if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Every number of the printed summary, as plain JSON-ready data."""
        return summary(self)

    def save(self, folder: str | Path, program: Any = None) -> list[Path]:
        """Write the dump (stage graphs, Inductor code of `program`'s compiled stages,
        schedule and partition charts, plan.json) to `folder`; returns the files."""
        from tokpipe_compiler.inspection.dump import save_plan

        return save_plan(self, Path(folder), program)

    def __str__(self) -> str:
        from tokpipe_compiler.inspection.report import format_plan

        return format_plan(self)


def summary(plan: Plan) -> dict[str, Any]:
    chunks = plan.chunks
    return {
        "config": plan.config.as_dict(),
        "token_input": plan.token_input,
        "units": plan.units,
        "tokens": plan.tokens,
        "text_tokens": plan.text_tokens,
        "imbalance": plan.imbalance,
        "imbalance_warning": plan.imbalance_warning,
        "tail_ops": list(plan.tail_ops),
        "model_param_bytes": plan.model_param_bytes,
        "prelude": {"nodes": node_count(plan.graphs.prelude),
                    "param_bytes": plan.prelude_param_bytes,
                    "flops_per_call": plan.prelude_flops()},
        "stages": [{
            "index": s.index,
            "layers": s.layers,
            "modules": s.modules,
            "nodes": s.node_count,
            "param_bytes": s.param_bytes,
            "prelude_param_bytes": s.prelude_param_bytes,
            "flops_per_chunk": [plan.stage_flops(s.index, c) for c in chunks],
            "send_bytes_per_chunk": [plan.send_bytes(s.index, c) for c in chunks],
            "kv_cache_bytes": s.kv_cache_bytes,
        } for s in plan.stages],
        "chunks": [{
            "index": c.index,
            "units": [c.start, c.stop],
            "tokens": [c.start * plan.tokens // plan.units, c.stop * plan.tokens // plan.units],
            "context_tokens": plan.context_tokens(c),
            "flops": sum(plan.stage_flops(s.index, c) for s in plan.stages),
        } for c in chunks],
        "schedule": {"world": len(plan.stages),
                     "ranks": [list(map(str, r)) for r in plan.distributed_schedule().ranks]},
        "bubble": {"basis": "stage FLOPs per chunk (costmodel/cost.py), costmodel/pipeline_time",
                   "per_call": plan.bubble_fraction(1),
                   "ring": plan.bubble_fraction(RING_STEPS), "ring_steps": RING_STEPS},
    }


# ---- building the stage descriptions (called by the driver) ----------------------------


def describe_stages(
    graphs: SplitGraphs, caches: list[AnyCacheSpec], cut: Partition, costs: list[Cost]
) -> list[StagePlan]:
    by_cache = {name: c for c in caches for name in c.names}
    plans = []
    for stage, held in zip(graphs.stages, params.held_by_stage(graphs), strict=True):
        nodes = [n for n in stage.gm.graph.nodes if n.op not in ("placeholder", "output")]
        plans.append(StagePlan(
            index=stage.index,
            graph=stage,
            modules=_modules(nodes),
            node_count=node_count(stage.gm),
            param_bytes=held.total,
            prelude_param_bytes=held.prelude,
            cost=costs[stage.index],
            send_bytes_per_unit=_send_bytes(stage, graphs),
            send_text_bytes=_send_bytes(stage, graphs, text=True),
            caches=sorted({by_cache[i.name] for i in stage.inputs if i.name in by_cache},
                          key=lambda c: c.layer),
            layer_flops=_layer_flops(cut, stage.index),
        ))
    return plans


def _modules(nodes: list[torch.fx.Node]) -> list[str]:
    paths: list[str] = []
    for node in nodes:
        path = module_path(node)
        if path and (not paths or paths[-1] != path):
            paths.append(path)
    return paths


def _layer_flops(cut: Partition, stage: int) -> list[tuple[str, float]]:
    """Each layer of the stage once, in order of its first node, with its nodes' summed
    weights (a traced graph interleaves a block's nodes with top-level ones)."""
    flops: dict[str, float] = {}
    for node, weight in zip(cut.order, cut.weights, strict=True):
        if cut.stage_of[node] == stage:
            layer = layer_of(module_path(node)) or "(top level)"
            flops[layer] = flops.get(layer, 0.0) + weight
    return list(flops.items())


def _send_bytes(stage: StageGraph, graphs: SplitGraphs, text: bool = False) -> int:
    """Bytes `stage` sends to later stages per token-grid unit, or (`text`) of the text
    segments' rows, which a chunk that computes them sends once whatever its length."""
    sent = {i.name for g in graphs.stages for i in g.inputs
            if i.kind == BOUNDARY and i.producer == stage.index}
    total = 0
    for node in stage.gm.graph.nodes:
        if node.name in sent and node.op != "placeholder":
            value = example_value(node)
            info = stage.output_infos[node.name]
            if info.axis is None or not info.carries_tokens:
                continue  # a value sent whole does not change with the chunk
            rows = value.numel() // value.shape[info.axis]
            per_block = info.lead + info.trail if text else info.per_unit or 0
            total += rows * per_block * info.outer * value.element_size()
    return total
