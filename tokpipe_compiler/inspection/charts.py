"""Pictures of a plan: the predicted schedule per rank, and which layers sit on which stage.

Both use matplotlib's object API (no pyplot), so they never touch the user's backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokpipe_compiler.costmodel.pipeline_time import Box

if TYPE_CHECKING:
    from tokpipe_compiler.planning.plan import Plan


def predicted_boxes(plan: Plan, steps: int = 2) -> list[Box]:
    """When each rank computes what, with stage times from FLOPs per chunk (the largest
    scaled to 1) and free links. Each step is one call: it starts when the last one ends,
    as in a denoising loop that runs the scheduler between calls."""
    flops = plan.chunk_flops()
    scale = max(max(row) for row in flops) or 1.0
    return plan.predicted_boxes(steps, times=[[f / scale for f in row] for row in flops])


def schedule_chart(plan: Plan, path: Path, steps: int = 2) -> None:
    """PNG: one row per rank, one box per chunk and step, coloured by step."""
    from matplotlib.figure import Figure

    boxes = predicted_boxes(plan, steps)
    ranks = len(plan.stages)
    fig = Figure(figsize=(max(6.0, 0.5 * len(boxes) / ranks + 3), 0.6 * ranks + 1.6))
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(steps)]
    for box in boxes:
        ax.broken_barh([(box.start, box.end - box.start)], (box.rank - 0.4, 0.8),
                       facecolors=colours[box.step], edgecolor="black", linewidth=0.5)
        ax.text((box.start + box.end) / 2, box.rank, str(box.chunk), ha="center", va="center",
                fontsize=8)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted time (slowest stage chunk = 1; from FLOPs per chunk)")
    handles = [_patch(colours[s], f"step {s}") for s in range(steps)]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_title(f"{ranks} stages x {len(plan.chunks)} chunks, mode={plan.config.mode}: "
                 "boxes are chunks; each step fills and drains", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def partition_chart(plan: Plan, path: Path) -> None:
    """PNG: one bar per layer of each stage (FLOPs of a typical chunk), coloured by stage."""
    from matplotlib.figure import Figure

    rows = [(s.index, layer, flops) for s in plan.stages for layer, flops in s.layer_flops
            if flops > 0]
    fig = Figure(figsize=(7.0, 0.25 * len(rows) + 1.5))
    ax = fig.add_subplot()
    for y, (stage, _, flops) in enumerate(rows):
        ax.barh(y, flops, color=f"C{stage % 10}")
    ax.set_yticks(range(len(rows)), [layer for _, layer, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("FLOPs of one chunk")
    handles = [_patch(f"C{s.index % 10}", f"stage {s.index}") for s in plan.stages]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_title("partition: layers in graph order, coloured by stage", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, edgecolor="black", label=label)
