"""The compiler driver: every pass, in order, in one place.

    annotate -> partition -> chunk_attention -> chunk_sums -> weight_transforms -> split
                                                              (here, once per graph)
    specialize -> compile                                     (later, per stage and chunk
                                                               length, on the rank that runs it)

Each pass runs through `run_pass`, which names it, dumps its graph when logging asks
(TOKPIPE_LOGS=passes) and checks what it promises. Between them, the driver asks the cost
model for the chunk table and the stage weights. The meta keys each pass reads and writes
(their meaning: `core/meta.py`):

| pass              | reads               | writes                                     |
|-------------------|---------------------|--------------------------------------------|
| annotate          | SOURCE_KEY          | META_KEY on every node                     |
| partition         | META_KEY            | STAGE_KEY on every node a stage computes   |
| chunk_attention   | META_KEY            | kv_attention nodes (META_KEY copied)       |
| chunk_sums        | META_KEY            | partial-sum op nodes (META_KEY copied)     |
| weight_transforms | META_KEY, STAGE_KEY | STAGE_KEY on what one stage's weights need |
| split             | META_KEY, STAGE_KEY | the stage graphs and the prelude           |
| specialize        | META_KEY            | a stage graph at one chunk length          |
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.fx

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import OneUnitGrid
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.logs import LOG, log_plan
from tokpipe_compiler.core.meta import (
    ATTENTION,
    INVARIANT_INFO,
    META_KEY,
    SOURCE_KEY,
    STAGE_KEY,
)
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.costmodel import planning_costs
from tokpipe_compiler.costmodel.chunk_choice import choose_causal, choose_stale
from tokpipe_compiler.passes.annotate import Annotation, annotate, raise_unsupported
from tokpipe_compiler.passes.chunk_attention import chunk_attention
from tokpipe_compiler.passes.chunk_sums import chunk_sums
from tokpipe_compiler.passes.partition import ImbalanceWarning, Partition, partition
from tokpipe_compiler.passes.split import split
from tokpipe_compiler.passes.text_once import why_kept
from tokpipe_compiler.passes.weight_transforms import place_weight_transforms
from tokpipe_compiler.planning.pass_runner import (
    PassSpec,
    annotated,
    attention_chunked,
    nothing,
    run_pass,
    staged,
    sums_chunked,
)
from tokpipe_compiler.planning.plan import Plan, describe_stages
from tokpipe_compiler.runtime.chunking import (
    Chunk,
    chunk_table,
    table_from_sizes,
    table_from_tokens,
    with_first_segments,
)
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT

ANNOTATE = PassSpec("annotate", (SOURCE_KEY,), (META_KEY,), annotated)
PARTITION = PassSpec("partition", (META_KEY,), (STAGE_KEY,), staged)
CHUNK_ATTENTION = PassSpec("chunk_attention", (META_KEY,), (META_KEY,), attention_chunked)
CHUNK_SUMS = PassSpec("chunk_sums", (META_KEY,), (META_KEY,), sums_chunked)
WEIGHT_TRANSFORMS = PassSpec("weight_transforms", (META_KEY, STAGE_KEY), (STAGE_KEY,), nothing)
SPLIT = PassSpec("split", (META_KEY, STAGE_KEY), (), nothing,
                 made=lambda graphs, gm: [(f"stage_{s.index}", s.gm) for s in graphs.stages])


def build_plan(gm: torch.fx.GraphModule, config: Config, ring_steps: int | None = None) -> Plan:
    """Dynamo's graph -> a Plan (stages, chunk table, schedule). `gm` is left untouched.
    `ring_steps`: the plan runs as a ring of that many steps (chunks="auto" chooses for it)."""
    gm = copy_graph_module(gm)
    annotation = run_pass(ANNOTATE, annotate_or_raise, gm, config.token_input, config.mode)
    tokens = sequence_tokens(gm, annotation.units, token_batch(gm, annotation))
    once = text_once(gm, config)
    chunks = plan_chunks(gm, annotation, tokens, config, ring_steps, once)
    if once and len(chunks) > 1:
        chunks = with_first_segments(chunks)
    chunk_tokens = tokens * chunks[0].units // annotation.units
    cut = run_pass(PARTITION, assign_stages, gm, config.stages, tokens, chunk_tokens,
                   planning_costs.send_cost(annotation.token_input),
                   text_share(chunks, chunk_tokens, tokens))
    costs = planning_costs.stage_costs(cut, config.stages, tokens)  # before sdpa is rewritten
    if len(chunks) > 1 and not config.cuda_graphs:
        warn_launch_bound(costs, chunk_tokens, tokens, annotation.token_input)
    caches = run_pass(CHUNK_ATTENTION, chunk_attention, gm, config.mode, config.attention)
    caches = caches + run_pass(CHUNK_SUMS, chunk_sums, gm, config.mode)
    runtime_inputs = {CHUNK_INPUT} | {n for c in caches for n in c.names}
    run_pass(WEIGHT_TRANSFORMS, place_weight_transforms, gm)
    graphs = run_pass(SPLIT, split, gm, config.stages, runtime_inputs)
    consumers = {s: {i_stage.index for i_stage in graphs.stages for i in i_stage.inputs
                     if i.producer == s} for s in range(config.stages)}
    stages = describe_stages(graphs, caches, cut, costs)
    plan = Plan(config, graphs, stages, chunks, annotation.units, annotation.token_input.name,
                caches, consumers, tokens, cut.imbalance, cut.warning)
    log_plan(plan)
    return plan


def warn_launch_bound(costs: list, chunk_tokens: int, tokens: int,
                      token_input: torch.fx.Node) -> None:
    """On a CUDA device, says so when a stage's chunks are predicted to take longer to
    launch than to run: the pipeline then runs at the host's pace."""
    bound = planning_costs.launch_bound(costs, chunk_tokens, tokens, token_input)
    if bound:
        stage, launching, running = max(bound, key=lambda b: b[1] / b[2])
        warn(f"chunks of {chunk_tokens} tokens are predicted to take the host longer to "
             f"launch than the GPU to run on {len(bound)} of {len(costs)} stages (stage "
             f"{stage}: {1e3 * launching:.2f} ms of kernel launches against "
             f"{1e3 * running:.2f} ms of work), so the pipeline would run at the host's pace;"
             f" pass cuda_graphs=True to replay each chunk from a CUDA graph, or fewer chunks")


def text_once(gm: torch.fx.GraphModule, config: Config) -> bool:
    """Whether each step's first chunk alone computes the text segments of joint attention
    (`passes/text_once.py`), as the mode, the option and the graph allow; the chunk table
    then marks its first chunk (`with_first_segments`)."""
    if config.mode != "stale" or config.text_chunks != "first":
        return False
    if not any(n.meta.get(META_KEY, INVARIANT_INFO).segmented for n in gm.graph.nodes):
        return False
    reason = why_kept(gm)
    if reason:
        LOG.info("every chunk computes the text segments: %s", reason)
    return not reason


def text_share(chunks: list[Chunk], chunk_tokens: int, tokens: int) -> float:
    """The share of the text segments (`cost.TEXT`) that weighs a node at `chunk_tokens`
    in the partition: the text's work of a step (once per chunk that computes it) in the
    proportion a chunk's image rows have to the step's."""
    return sum(c.segments for c in chunks) * chunk_tokens / max(tokens, 1)


def token_batch(gm: torch.fx.GraphModule, annotation: Annotation) -> int:
    """Samples in a call as attention sees them: the most rows of any token-carrying value
    shaped like the token input but for its leading axis. Guidance makes it 2, batched by
    the pipeline (the token input's own leading axis) or inside a traced denoising step,
    where the token input is the one latent and the step batches `torch.cat([latents] * 2)`.
    A video folding frames into the batch axis changes the value's rank, and a sequence
    flattened to [batch * tokens, width] its token axis: neither is counted."""
    value = example_value(annotation.token_input)
    if not (isinstance(value, torch.Tensor) and value.dim() > 1):
        return 1
    axis = annotation.token_input.meta[META_KEY].axis  # a flattened [B*L, D] is no match
    rows = [int(other.shape[0]) for node in gm.graph.nodes
            if (info := node.meta.get(META_KEY)) is not None and info.carries_tokens
            and info.axis == axis and isinstance(other := example_value(node), torch.Tensor)
            and other.shape[1:] == value.shape[1:]]
    return max([int(value.shape[0]), *rows])


def annotate_or_raise(gm: torch.fx.GraphModule, token_input: str | int | None,
                      mode: str = "stale") -> Annotation:
    """annotate, with a graph that mixes tokens unchunkably reported as the user's error
    (in sync mode, which chunks nothing, such ops run whole instead)."""
    annotation = annotate(gm, token_input, mode)
    if annotation.unsupported and annotation.units == 1:
        raise OneUnitGrid(
            "the token grid of this input is one unit (an image's row of patches, a "
            "video's latent frame, a sequence's one token), where nothing is left to cut "
            "into chunks and the token axis cannot be told from a whole segment's; run it "
            "whole (mode='sync', or unpipelined: options={'fallback': True}, as a language "
            "model's decode steps, one token a call, need), or give it two units or more")
    if annotation.unsupported:
        raise_unsupported(annotation, mode)
    return annotation


def assign_stages(gm: torch.fx.GraphModule, stages: int, tokens: int, chunk_tokens: int,
                  flops_per_byte: float, text: float = 1.0) -> Partition:
    """partition, its stages written on the nodes for split."""
    cut = partition(gm, stages, planning_costs.flops_weight(tokens, chunk_tokens, text),
                    chunk_tokens / max(tokens, 1), flops_per_byte)
    warn_idle_stages(cut, stages)
    for node, stage in cut.stage_of.items():
        node.meta[STAGE_KEY] = stage
    return cut


def idle_stages(cut: Partition) -> list[int]:
    """The stages the cuts leave no FLOP (only views between their cuts)."""
    bounds = [0, *cut.cuts, len(cut.weights)]
    return [s for s, (a, b) in enumerate(pairwise(bounds)) if not any(cut.weights[a:b])]


def warn_idle_stages(cut: Partition, stages: int) -> None:
    """More stages than the model's work spreads over: the idle ranks only pass values on.
    A warning, not an error: a graph that a graph break cut short (offloading hooks split
    a block into pieces) gets the model's stage count without the user choosing it."""
    idle = idle_stages(cut)
    if stages > 1 and idle:
        warn(f"tokpipe: stages={stages} leaves stage(s) {', '.join(map(str, idle))} of this "
             "graph nothing to compute (no FLOP: only views fall between its cuts); they "
             "only pass values on: use fewer stages", ImbalanceWarning)


def _fitted_chunk_count(chunks: int, units: int, tokens: int) -> int:
    """`chunks`, or the grid's unit count where it has fewer (a short video, a low image:
    requests of a server vary), said in a warning. A chunk is whole units of the token
    grid: the warning says how large one is here, which is more than a row of patches
    where the model merges rows (an hourglass DiT)."""
    if chunks <= units:
        return chunks
    warn(f"tokpipe: chunks={chunks} is more than the {units} units of this input's token "
         f"grid ({tokens} tokens, {tokens // units} a unit; a unit is the first axis of the "
         "grid at its coarsest: an image's row of patches, a video's latent frame, or "
         f"several rows where the model merges them): it runs {units} chunk(s). "
         'chunks="auto" chooses the count for each input size')
    return units


def plan_chunks(
    gm: torch.fx.GraphModule, annotation: Annotation, tokens: int, config: Config,
    ring_steps: int | None = None, once: bool = False,
) -> list[Chunk]:
    units = annotation.units
    if isinstance(config.chunks, tuple):  # checked in sync too: the same options run stale
        table = table_from_tokens(units, tokens, config.chunks)
        if config.mode != "sync":
            return table
    if config.mode == "sync":
        return chunk_table(units, 1)
    if config.chunks != "auto":
        table = chunk_table(units, _fitted_chunk_count(config.chunks, units, tokens))
        # the first chunk computes the step's text stream: an uneven split's smaller
        # chunks go first, so as not to load it twice
        return table_from_sizes([c.units for c in reversed(table)]) if once else table
    first = chunk_table(units, min(config.stages, units))[0]
    chunk_tokens = tokens * first.units // units
    share = chunk_tokens / tokens if once else 1.0  # as text_share, for a table yet to come
    provisional = partition(gm, config.stages,
                            planning_costs.flops_weight(tokens, chunk_tokens, share),
                            chunk_tokens / max(tokens, 1))
    stage_times = planning_costs.stage_times(provisional, config.stages, tokens,
                                             annotation.token_input, config.cuda_graphs)
    if config.mode == "causal":
        chunks = choose_causal(units, tokens, stage_times)
    else:
        chunks = choose_stale(units, tokens, stage_times, ring_steps, once)
    LOG.info("chunks='auto' (%s): %d chunks of %s grid units", config.mode, len(chunks),
             [c.units for c in chunks])
    return chunks


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def sequence_tokens(gm: torch.fx.GraphModule, units: int, batch: int = 1) -> int:
    """Image (video) tokens of one sample: the most query rows of any token-mixing
    attention, its text segments, heads and `batch` rows left out (the longest token axis
    when there is no attention).

    Not units x tokens per unit of the attention axis: a video chunked by frames attends
    over one frame per unit along its temporal attention and keeps each frame's pixels on
    another axis (spatial attention puts frames on the batch axis), so that would count
    frames, not tokens.
    """
    infos = [(n, n.meta[META_KEY]) for n in gm.graph.nodes if n.op != "output"]
    attention = [(node, info) for node, info in infos if info.kind == ATTENTION]
    rows = [_query_rows(node, info, units, batch) for node, info in attention]
    return max(rows or [units * i.per_unit for _, i in infos if i.carries_tokens])


def _query_rows(node: torch.fx.Node, info, units: int, batch: int) -> int:
    """Rows of an attention output [B, heads, L, D] per sample, segments excluded (other
    layouts, where heads may hide in the batch axis: units x the axis' tokens per unit)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or info.axis != 2:
        return units * info.per_unit
    seq = value.shape[2]
    per_sample = value.numel() // value.shape[3] // value.shape[1] // max(batch, 1)
    return per_sample * (seq - info.lead - info.trail) // max(seq, 1)


