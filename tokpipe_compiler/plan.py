"""The Plan: what the compiler made (stages, their graphs and costs, chunks, schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokpipe_compiler.graph_utils import example_value, is_parameter, module_path
from tokpipe_compiler.passes.partition import Partition
from tokpipe_compiler.passes.split import BOUNDARY, CALL, SplitGraphs, StageGraph
from tokpipe_compiler.runtime.caches import CacheSpec
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.schedule import Schedule

from .config import Config


@dataclass
class StagePlan:
    index: int
    graph: StageGraph
    modules: list[str]  # module paths whose nodes run in this stage, in order
    node_count: int
    param_bytes: int
    weight: float  # FLOPs of the stage on the full sequence (the partition's balance)
    send_bytes_per_unit: int  # bytes to later stages per token-grid unit
    caches: list[CacheSpec] = field(default_factory=list)

    @property
    def code(self) -> str:
        """The stage graph as Python source (at full sequence length)."""
        return self.graph.gm.code

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.bytes for c in self.caches)


@dataclass
class Plan:
    config: Config
    graphs: SplitGraphs
    stages: list[StagePlan]
    chunks: list[Chunk]
    units: int  # rows of the token grid
    token_input: str
    caches: list[CacheSpec]
    schedule: Schedule
    consumers: dict[int, set[int]]

    def __str__(self) -> str:
        c = self.config
        lines = [f"tokpipe plan: {len(self.stages)} stages, {len(self.chunks)} chunks, "
                 f"mode={c.mode}, token input '{self.token_input}' ({self.units} grid rows)"]
        lines.append(f"{'stage':>5} {'nodes':>6} {'params':>10} {'GFLOP':>8} "
                     f"{'send/row':>9} {'kv cache':>10}  modules")
        for s in self.stages:
            lines.append(f"{s.index:>5} {s.node_count:>6} {_mib(s.param_bytes):>10} "
                         f"{s.weight / 1e9:>8.3f} {_kib(s.send_bytes_per_unit):>9} "
                         f"{_mib(s.kv_cache_bytes):>10}  {_span(s.modules)}")
        table = " ".join(f"[{k.start},{k.stop})" for k in self.chunks)
        lines.append(f"chunks (grid rows): {table}")
        lines.append("schedule:\n" + str(self.schedule))
        return "\n".join(lines)


def describe_stages(
    graphs: SplitGraphs, caches: list[CacheSpec], cut: Partition
) -> list[StagePlan]:
    by_cache = {name: c for c in caches for name in (c.k_name, c.v_name)}
    weight = [0.0] * len(graphs.stages)
    for node, w in zip(cut.order, cut.weights, strict=True):
        weight[cut.stage_of[node]] += w
    plans = []
    for stage in graphs.stages:
        nodes = [n for n in stage.gm.graph.nodes if n.op not in ("placeholder", "output")]
        plans.append(StagePlan(
            index=stage.index,
            graph=stage,
            modules=_modules(nodes),
            node_count=len(nodes),
            param_bytes=_param_bytes(stage),
            weight=weight[stage.index],
            send_bytes_per_unit=_send_bytes(stage, graphs),
            caches=sorted({by_cache[i.name] for i in stage.inputs if i.name in by_cache},
                          key=lambda c: c.layer),
        ))
    return plans


def _modules(nodes: list[torch.fx.Node]) -> list[str]:
    paths: list[str] = []
    for node in nodes:
        path = module_path(node)
        if path and (not paths or paths[-1] != path):
            paths.append(path)
    return paths


def _param_bytes(stage: StageGraph) -> int:
    total = 0
    for node in stage.gm.graph.nodes:
        spec = next((i for i in stage.inputs if i.name == node.name), None)
        if spec is not None and spec.kind == CALL and is_parameter(node):
            value = example_value(node)
            total += value.numel() * value.element_size()
    return total


def _send_bytes(stage: StageGraph, graphs: SplitGraphs) -> int:
    sent = {i.name for g in graphs.stages for i in g.inputs
            if i.kind == BOUNDARY and i.producer == stage.index}
    total = 0
    for node in stage.gm.graph.nodes:
        if node.name in sent and node.op != "placeholder":
            value = example_value(node)
            axis, per_unit = stage.output_infos[node.name]
            total += value.numel() // value.shape[axis] * per_unit * value.element_size()
    return total


def _span(modules: list[str]) -> str:
    if not modules:
        return "-"
    return modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}MiB"


def _kib(n: int) -> str:
    return f"{n / 2**10:.1f}KiB"
