"""Pictures of a plan: the predicted schedule per rank, and which layers sit on which stage.

Both use matplotlib's object API (no pyplot), so they never touch the user's backend.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokpipe_compiler.costmodel.pipeline_time import Box

if TYPE_CHECKING:
    from tokpipe_compiler.planning.plan import Plan


WHOLE = -1  # the chunk of a box that runs the whole sequence (warmup, sync)


def _scaled_flops(plan: Plan) -> list[list[float]]:
    flops = plan.chunk_flops()
    scale = max(max(row) for row in flops) or 1.0
    return [[f / scale for f in row] for row in flops]


def predicted_boxes(plan: Plan, steps: int = 2, ring: bool = False) -> list[Box]:
    """When each rank computes what, with stage times from FLOPs per chunk (the largest
    scaled to 1) and free links. Per call (ring=False) each step starts when the last one
    ends, as in a denoising loop that runs the scheduler between calls; a ring runs the
    steps back to back."""
    return plan.predicted_boxes(steps, ring=ring, times=_scaled_flops(plan))


def whole_steps(plan: Plan, steps: int) -> int:
    """Steps that run the whole sequence stage after stage: every sync step, stale's
    warmup steps."""
    mode = plan.config.mode
    if mode == "sync":
        return steps
    return min(plan.config.warmup_steps, steps) if mode == "stale" else 0


def schedule_boxes(plan: Plan, steps: int = 3, ring: bool = False) -> list[Box]:
    """The boxes the schedule chart draws: the whole-sequence steps first (one box per
    stage, chunk WHOLE, each stage after the one before), then the chunked steps, per call
    or as one ring."""
    flops = _scaled_flops(plan)
    boxes, end = [], 0.0
    for step in range(whole_steps(plan, steps)):
        for stage, row in enumerate(flops):
            boxes.append(Box(stage, stage, WHOLE, step, end, end + sum(row)))
            end += sum(row)
    first = len(boxes) // max(len(flops), 1)
    chunked = predicted_boxes(plan, steps - first, ring) if steps > first else []
    return boxes + [replace(b, step=b.step + first, start=b.start + end, end=b.end + end)
                    for b in chunked]


def schedule_chart(plan: Plan, path: Path, steps: int = 3, ring: bool = False) -> None:
    """PNG: one row per rank, one box per chunk and step, coloured by step; whole-sequence
    steps (warmup, sync) as one hatched box per stage."""
    from matplotlib.figure import Figure

    boxes = schedule_boxes(plan, steps, ring)
    ranks = len(plan.stages)
    fig = Figure(figsize=(max(6.0, 0.5 * len(boxes) / ranks + 3), 0.6 * ranks + 1.6))
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(steps)]
    for box in boxes:
        whole = box.chunk == WHOLE
        ax.broken_barh([(box.start, box.end - box.start)], (box.rank - 0.4, 0.8),
                       facecolors=colours[box.step], edgecolor="black", linewidth=0.5,
                       hatch="//" if whole else None)
        ax.text((box.start + box.end) / 2, box.rank, "all" if whole else str(box.chunk),
                ha="center", va="center", fontsize=8)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted time (slowest stage's chunk = 1; from FLOPs per chunk)")
    warm = whole_steps(plan, steps)
    handles = [_patch(colours[s], f"step {s}" + (" (whole)" if s < warm else ""))
               for s in range(steps)]
    # beside the boxes, not over them (the last rank's last chunks sat under it)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    how = "one ring: the steps run back to back" if ring else "each call fills and drains"
    ax.set_title(f"{ranks} stages x {len(plan.chunks)} chunks, mode={plan.config.mode}: "
                 f"boxes are chunks ('all': the whole sequence)\n{how}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def partition_chart(plan: Plan, path: Path) -> None:
    """PNG: one bar per layer of each stage (FLOPs of a typical chunk), coloured by stage."""
    from matplotlib.figure import Figure

    rows = [(s.index, layer, flops / 1e9) for s in plan.stages
            for layer, flops in s.layer_flops if flops > 0]
    fig = Figure(figsize=(7.0, 0.25 * len(rows) + 1.5))
    ax = fig.add_subplot()
    for y, (stage, _, flops) in enumerate(rows):
        ax.barh(y, flops, color=f"C{stage % 10}")
    ax.set_yticks(range(len(rows)), [layer for _, layer, _ in rows], fontsize=7)
    ax.invert_yaxis()
    tokens = plan.chunk_tokens(plan.chunks[0])
    ax.set_xlabel(f"GFLOP per chunk of {tokens} tokens (chunk 0; the partition's weights)")
    handles = [_patch(f"C{s.index % 10}", f"stage {s.index}") for s in plan.stages]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_title("partition: layers in graph order, coloured by stage", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, edgecolor="black", label=label)
