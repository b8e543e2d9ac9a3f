"""plan.save(folder): everything about a plan as files that open in ordinary tools.

    plan.txt                  the printed summary
    plan.json                 every number of the summary
    prelude.py, stage_<i>.py  the graphs (full sequence length), as Python
    stage_<i>_inductor_<n>u.py  Inductor's output code, for stages compiled at n grid rows
                                (`_<n>u_rows.py`: a chunk without the text segments)
    schedule.png              predicted schedule: a row per rank, a box per chunk and step
    partition.png             which layers run on which stage
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx

if TYPE_CHECKING:
    from tokpipe_compiler.planning.plan import Plan

log = logging.getLogger("tokpipe_compiler")


def save_plan(plan: Plan, folder: Path, program: Any = None) -> list[Path]:
    """`program`: a PipelinedProgram that ran the plan, for its compiled stages."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [_write(folder / "plan.txt", str(plan) + "\n"),
             _write(folder / "plan.json", json.dumps(plan.summary(), indent=1) + "\n"),
             _write(folder / "prelude.py", graph_source(plan.graphs.prelude, "prelude: "
                    "invariant values (timestep, text conditioning), once per call"))]
    for stage in plan.stages:
        what = f"stage {stage.index}: {', '.join(stage.layers) or '-'}"
        files.append(_write(folder / f"stage_{stage.index}.py",
                            graph_source(stage.graph.gm, what)))
    if program is not None:
        files += _inductor_code(program, folder)
    return files + _charts(plan, folder)


def graph_source(gm: torch.fx.GraphModule, what: str) -> str:
    """A graph as an importable-looking Python module (shapes in the annotations)."""
    body = gm.print_readable(print_output=False)
    return f'"""{what}"""\nimport torch\n\n\n{body}\n'


def inductor_source(fn: Any) -> str | None:
    """Inductor's generated Python for a stage compiled by compile_fx, if there is one."""
    for obj in (fn, getattr(fn, "__wrapped__", None)):
        code = getattr(obj, "source_code", None)
        if isinstance(code, str) and code:
            return code
    return None


def _inductor_code(program: Any, folder: Path) -> list[Path]:
    files = []
    for index, stage in enumerate(program.stage_programs):
        for (units, segments), fn in sorted(stage.compiled.items()):
            code = inductor_source(fn)
            rows = "" if segments else "_rows"  # a chunk without the text segments
            if code is not None:
                files.append(_write(folder / f"stage_{index}_inductor_{units}u{rows}.py", code))
    return files


def _charts(plan: Plan, folder: Path) -> list[Path]:
    try:
        from tokpipe_compiler.inspection.charts import partition_chart, schedule_chart
    except ImportError:  # matplotlib is an optional extra ("plots")
        log.warning("matplotlib is not installed: plan.save skips the PNG charts")
        return []
    schedule_chart(plan, folder / "schedule.png")
    schedule_chart(plan, folder / "schedule_ring.png", steps=4, ring=True)
    partition_chart(plan, folder / "partition.png")
    return [folder / "schedule.png", folder / "schedule_ring.png", folder / "partition.png"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
