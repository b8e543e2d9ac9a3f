"""A real run's timeline: as a Chrome trace, and measured against predicted per stage.

    program = tokpipe_compiler.programs(compiled)[0]          # after a few calls
    write_chrome_trace(program.timeline, "trace.json")       # ui.perfetto.dev, chrome://tracing
    print(format_comparison(compare(program.plan, program.timeline)))

Each rank is a process; each stage has a row for its computes and one for its sends,
receives and waits. Events gathered from several ranks share one clock when the ranks share
a machine (time.perf_counter is system-wide there).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokpipe_compiler.runtime.executor import Event, Timeline

if TYPE_CHECKING:
    from tokpipe_compiler.costmodel.calibrate import DeviceRates
    from tokpipe_compiler.planning.plan import Plan

COMPUTE = "compute"


def chrome_trace(events: Timeline | Iterable[Event]) -> dict[str, Any]:
    """The Trace Event Format: complete ('X') events in microseconds, with names for every
    process (rank) and thread (a stage's compute or communication row)."""
    events = list(events.events if isinstance(events, Timeline) else events)
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append(_meta("process_name", rank, 0, f"rank {rank}"))
    for rank, stage in sorted({(e.rank, e.stage) for e in events}):
        trace.append(_meta("thread_name", rank, _tid(stage, COMPUTE), f"stage {stage} compute"))
        trace.append(_meta("thread_name", rank, _tid(stage, "send"), f"stage {stage} send/recv"))
    for e in events:
        trace.append({
            "name": f"{e.kind} {e.stage}.{e.chunk}", "cat": e.kind, "ph": "X",
            "ts": (e.start - origin) * 1e6, "dur": e.duration * 1e6,
            "pid": e.rank, "tid": _tid(e.stage, e.kind),
            "args": {"stage": e.stage, "chunk": e.chunk, "step": e.step, "units": e.units},
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Timeline | Iterable[Event], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def _tid(stage: int, kind: str) -> int:
    return 2 * stage + (kind != COMPUTE)


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}


@dataclass(frozen=True)
class StageTiming:
    """Seconds of one chunk of a stage: the median measured, and the cost model's median
    over the plan's chunks."""

    stage: int
    samples: int
    measured_s: float
    predicted_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s else float("inf")


def compare(plan: Plan, events: Timeline | Iterable[Event],
            rates: DeviceRates | None = None) -> list[StageTiming]:
    """Measured compute per chunk against the prediction, per stage. Warmup calls (whole
    sequence) are left out when the plan has several chunks. `rates`: the device's
    (default: the local CPU's, measured once and cached)."""
    from tokpipe_compiler.costmodel.calibrate import load_or_measure, seconds

    rates = rates or load_or_measure("cpu")
    events = list(events.events if isinstance(events, Timeline) else events)
    chunked = [e for e in events if e.kind == COMPUTE
               and (len(plan.chunks) == 1 or e.units != plan.units)]
    rows = []
    for stage in plan.stages:
        measured = [e.duration for e in chunked if e.stage == stage.index]
        predicted = [seconds(stage.cost, rates, plan.chunk_tokens(c), plan.context_tokens(c))
                     for c in plan.chunks]
        rows.append(StageTiming(stage.index, len(measured),
                                statistics.median(measured) if measured else float("nan"),
                                statistics.median(predicted)))
    return rows


def format_comparison(rows: list[StageTiming]) -> str:
    lines = [f"{'stage':>5} {'chunks':>6} {'measured ms':>12} {'predicted ms':>13} "
             f"{'measured/predicted':>19}"]
    for r in rows:
        lines.append(f"{r.stage:>5} {r.samples:>6} {r.measured_s * 1e3:>12.3f} "
                     f"{r.predicted_s * 1e3:>13.3f} {r.ratio:>19.2f}")
    return "\n".join(lines)
