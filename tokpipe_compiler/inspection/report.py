"""The printed form of a Plan: stage table, chunk table, schedule, predicted bubble."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokpipe_compiler.core.fx import argument_of, node_count
from tokpipe_compiler.runtime.caches import SumCacheSpec

if TYPE_CHECKING:
    from tokpipe_compiler.planning.plan import Plan

SCHEDULE_WIDTH = 16  # actions per rank shown; plan.json holds them all


def format_plan(plan: Plan) -> str:
    """The summary `print(plan)` shows."""
    return "\n".join([*_header(plan), "", *_stage_table(plan), "", *_chunk_table(plan), "",
                      *_schedule(plan), "", *_bubble(plan)])


def _header(plan: Plan) -> list[str]:
    c = plan.config
    warmup = f", {c.warmup_steps} warmup step(s)" if c.mode == "stale" else ""
    return [f"tokpipe plan: {len(plan.stages)} stage(s) x {len(plan.chunks)} chunk(s), "
            f"mode={c.mode}{warmup}, compiler={c.compiler}, attention={c.attention}"
            f"{', cuda_graphs' if c.cuda_graphs else ''}",
            f"token input {_token_argument(plan)!r}: {plan.units} grid rows, {plan.tokens} "
            "tokens; "
            f"weights (parameters and buffers) {human_bytes(plan.model_param_bytes)} (each "
            "counted once)", *_tail(plan)]


def _tail(plan: Plan) -> list[str]:
    """The ops that end the graph mixing every token: they run after the pipeline."""
    if not plan.tail_ops:
        return []
    return [f"after the pipeline, on its whole outputs, on every rank: {', '.join(plan.tail_ops)}"
            " and what they feed (ops that mix every token; the stages below hold the rest)"]


def _token_argument(plan: Plan) -> str:
    """The token input as the forward's (or a ring step's) argument, not its graph name."""
    node = next((n for n in plan.graphs.prelude.graph.nodes
                 if n.op == "placeholder" and n.name == plan.token_input), None)
    argument = None if node is None else argument_of(node)
    return plan.token_input if argument is None else str(argument)


def _stage_table(plan: Plan) -> list[str]:
    rows = [("stage", "layers", "nodes", "weights held", "FLOP/chunk", "send/chunk",
             "K/V cache")]
    largest = max(plan.chunks, key=lambda c: c.units)
    for s in plan.stages:
        rows.append((str(s.index), ", ".join(s.layers) or "-", str(s.node_count),
                     human_bytes(s.param_bytes),
                     human_count(max(plan.stage_flops(s.index, c) for c in plan.chunks)),
                     human_bytes(plan.send_bytes(s.index, largest)),
                     human_bytes(s.kv_cache_bytes)))
    rows.append(("all", "prelude (each rank runs what its stage reads)",
                 str(node_count(plan.graphs.prelude)), human_bytes(plan.prelude_param_bytes),
                 human_count(plan.prelude_flops()) + "/call", "-", "-"))
    balance = (f"balance: the slowest stage costs {plan.imbalance:.2f}x an even share"
               + (f" (unbalanced: {plan.imbalance_warning})" if plan.imbalance_warning else ""))
    notes = [balance, "FLOP/chunk and send/chunk: the largest chunk",
             "weights held: the parameters and buffers of the stage and of the prelude part "
             "its rank runs (shared conditioning on every rank); prelude: its weights, each "
             "once"]
    return _table(rows, left=frozenset({1})) + notes + _stale_beyond_attention(plan)


def _stale_beyond_attention(plan: Plan) -> list[str]:
    """In stale mode, the token mixers other than attention that read the previous step's
    values after a chunk: they weigh more on the drift than a stale key does."""
    if plan.config.mode != "stale":
        return []
    specs = {c for s in plan.stages for c in s.caches if isinstance(c, SumCacheSpec)}
    convs = sum(c.rows for c in specs)
    if not specs:
        return []
    return [f"stale beyond attention: {len(specs) - convs} sum(s) over tokens and {convs} "
            "convolution(s) across rows read the previous step's values after each chunk "
            "(a sum's stale part reaches every token of the chunk; a convolution's, the rows "
            "at chunk bounds): docs/models.md"]


def _chunk_table(plan: Plan) -> list[str]:
    rows = [("chunk", "grid rows", "tokens", "context", "FLOP (all stages)")]
    per_unit = plan.tokens // plan.units
    # joint attention's text, or tokens joined before or after the chunked ones (a class
    # token, registers): every chunk attends to them whole
    text = f" + {plan.text_tokens} unchunked" if plan.text_tokens else ""
    for c in plan.chunks:
        flops = sum(plan.stage_flops(s.index, c) for s in plan.stages)
        rows.append((str(c.index), f"[{c.start}, {c.stop})",
                     f"[{c.start * per_unit}, {c.stop * per_unit})",
                     f"{plan.context_tokens(c)}{text}", human_count(flops)))
    if not all(c.segments for c in plan.chunks):
        return [*_table(rows), "unchunked tokens (joint attention's text, class or register "
                "tokens): computed by each step's first chunk; the later ones attend to their "
                "cached K/V"]
    return _table(rows)


def _schedule(plan: Plan) -> list[str]:
    lines = ["schedule (rank r runs stage r; C compute, S send, R receive; stage.chunk):"]
    for rank, actions in enumerate(plan.distributed_schedule().ranks):
        shown = " ".join(map(str, actions[:SCHEDULE_WIDTH]))
        more = f" ... (+{len(actions) - SCHEDULE_WIDTH})" if len(actions) > SCHEDULE_WIDTH else ""
        lines.append(f"  rank {rank}: {shown}{more}")
    return lines


def _bubble(plan: Plan) -> list[str]:
    from tokpipe_compiler.planning.plan import RING_STEPS

    s, m = len(plan.stages), len(plan.chunks)
    warmup = plan.config.warmup_steps
    ring = (f"; {plan.bubble_fraction(RING_STEPS):.1%} over {RING_STEPS} chunked steps of a "
            "PipeFusion ring" + (f" (its {warmup} warmup step(s), run whole, not counted)"
                                 if warmup else "")
            if plan.config.mode == "stale" else "")  # only stale steps run as a ring
    return [f"predicted bubble (from stage FLOPs per chunk): {plan.bubble_fraction(1):.1%} "
            f"per call that fills and drains the pipeline ((S-1)/(M+S-1) = "
            f"{(s - 1) / (m + s - 1):.1%} if stages were balanced){ring}"]


def _table(rows: list[tuple[str, ...]], left: frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def human_bytes(n: float) -> str:
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def human_count(n: float, unit: str = "FLOP") -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"
