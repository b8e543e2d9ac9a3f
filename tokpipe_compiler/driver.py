"""The compiler driver: every pass, in order, in one place.

    annotate -> partition (balanced by cost) -> chunk_attention -> split -> schedule
    (compile runs later, per stage and chunk length, on the rank that runs the stage)
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.fx

from tokpipe_compiler.graph_utils import example_value
from tokpipe_compiler.passes.annotate import Annotation, annotate, raise_unsupported
from tokpipe_compiler.passes.chunk_attention import chunk_attention
from tokpipe_compiler.passes.chunking_choice import StageTime, choose_causal, choose_stale
from tokpipe_compiler.passes.partition import partition
from tokpipe_compiler.passes.split import STAGE_KEY, check_chunked_outputs, split
from tokpipe_compiler.runtime.chunking import Chunk, chunk_table, table_from_tokens
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT
from tokpipe_compiler.runtime.schedule import build_schedule
from tokpipe_compiler.tokens import ATTENTION, META_KEY

from . import calibrate
from .config import Config
from .logs import LOG, PLAN, dump_graph
from .plan import Plan, describe_stages, stage_costs


def build_plan(gm: torch.fx.GraphModule, config: Config, ring_steps: int | None = None) -> Plan:
    """Dynamo's graph -> a Plan (stages, chunk table, schedule). `gm` is left untouched.
    `ring_steps`: the plan runs as a ring of that many steps (chunks="auto" chooses for it)."""
    gm = copy_graph_module(gm)
    annotation = annotate(gm, config.token_input)
    if annotation.unsupported:
        raise_unsupported(annotation)
    dump_graph("annotate", gm)
    tokens = sequence_tokens(gm, annotation.units)
    chunks = plan_chunks(gm, annotation, tokens, config, ring_steps)
    cut = partition(gm, config.stages, tokens, tokens * chunks[0].units // annotation.units,
                    send_cost(annotation))
    for node, stage in cut.stage_of.items():
        node.meta[STAGE_KEY] = stage
    costs = stage_costs(cut, config.stages, tokens)  # before chunk_attention rewrites sdpa
    dump_graph("partition", gm)
    caches = chunk_attention(gm, config.mode)
    dump_graph("chunk_attention", gm)
    runtime_inputs = {CHUNK_INPUT} | {n for c in caches for n in (c.k_name, c.v_name)}
    if config.mode != "sync":
        check_chunked_outputs(gm)
    graphs = split(gm, config.stages, runtime_inputs)
    for stage in graphs.stages:
        dump_graph(f"split/stage_{stage.index}", stage.gm)
    consumers = {s: {i_stage.index for i_stage in graphs.stages for i in i_stage.inputs
                     if i.producer == s} for s in range(config.stages)}
    schedule = build_schedule(config.stages, len(chunks), consumers=consumers)
    stages = describe_stages(graphs, caches, cut, costs)
    plan = Plan(config, graphs, stages, chunks, annotation.units, annotation.token_input.name,
                caches, schedule, consumers, tokens)
    if PLAN.isEnabledFor(logging.INFO):
        PLAN.info("%s", plan)
    return plan


def plan_chunks(
    gm: torch.fx.GraphModule, annotation: Annotation, tokens: int, config: Config,
    ring_steps: int | None = None,
) -> list[Chunk]:
    units = annotation.units
    if config.mode == "sync":
        return chunk_table(units, 1)
    if isinstance(config.chunks, tuple):
        return table_from_tokens(units, tokens, config.chunks)
    if config.chunks != "auto":
        return chunk_table(units, config.chunks)
    stage_times = predicted_stage_times(gm, annotation, tokens, config.stages)
    if config.mode == "causal":
        chunks = choose_causal(units, tokens, stage_times)
    else:
        chunks = choose_stale(units, tokens, stage_times, ring_steps)
    LOG.info("chunks='auto' (%s): %d chunks of %s grid units", config.mode, len(chunks),
             [c.units for c in chunks])
    return chunks


def send_cost(annotation: Annotation) -> float:
    """FLOPs one byte sent between ranks is worth: the device's matrix rate over the link's
    bandwidth (gloo on a CPU copies through memory; GPUs are assumed on PCIe, the slower
    case). Zero when every stage runs in this process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 0.0
    value = example_value(annotation.token_input)
    device = str(value.device) if isinstance(value, torch.Tensor) else "cpu"
    rates = calibrate.load_or_measure(device)
    if device.startswith("cuda"):
        from .simulator import LINKS

        return rates.matmul_flops / LINKS["pcie4"].bandwidth
    return rates.matmul_flops / rates.mem_bandwidth


def predicted_stage_times(
    gm: torch.fx.GraphModule, annotation: Annotation, tokens: int, stages: int
) -> list[StageTime]:
    """Seconds per chunk of each stage of a provisional partition (one chunk per stage),
    at the calibrated rates of the device the token input lives on."""
    first = chunk_table(annotation.units, min(stages, annotation.units))[0]
    cut = partition(gm, stages, tokens, tokens * first.units // annotation.units)
    value = example_value(annotation.token_input)
    device = str(value.device) if isinstance(value, torch.Tensor) else "cpu"
    rates = calibrate.load_or_measure(device)
    return [calibrate.time_fn(cost, rates) for cost in stage_costs(cut, stages, tokens)]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def sequence_tokens(gm: torch.fx.GraphModule, units: int) -> int:
    """Tokens of the attention sequence (the longest token axis when there is none)."""
    infos = [n.meta[META_KEY] for n in gm.graph.nodes if n.op != "output"]
    attention = [i.per_unit for i in infos if i.kind == ATTENTION]
    return units * max(attention or [i.per_unit for i in infos if i.carries_tokens])

