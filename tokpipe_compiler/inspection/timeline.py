"""A real run's timeline: as a Chrome trace, merged across ranks, and measured against
predicted per stage.

    program = tokpipe_compiler.programs(compiled)[0]          # after a few calls
    write_chrome_trace(program.timeline, "trace.json")       # ui.perfetto.dev, chrome://tracing
    print(format_comparison(compare(program.plan, program.timeline)))

Under torch.distributed each rank writes its own file; one command merges them:

    write_chrome_trace(program.timeline, f"trace{rank}.json")     # on every rank
    python -m tokpipe_compiler.inspection.timeline merged.json trace0.json trace1.json

Each rank is a process; its rows are each stage's computes, its sends to each rank and its
receives from each rank (only rows that hold events). Steps count across calls; computes of a
whole-sequence step (warmup, sync mode) are named `whole`; an arrow (flow event) joins each
send to its receive. Ranks on one machine share one clock (time.perf_counter is system-wide
there), which each file keeps (`otherData.tokpipe_origin_s`) so that merging lines them up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokpipe_compiler.runtime.executor import Event, Timeline

if TYPE_CHECKING:
    from tokpipe_compiler.costmodel.calibrate import DeviceRates
    from tokpipe_compiler.planning.plan import Plan

COMPUTE, SEND, RECV = "compute", "send", "recv"
ORIGIN_KEY = "tokpipe_origin_s"  # otherData: the clock reading that ts 0 stands for
_ROW_BASE = {COMPUTE: 0, SEND: 1000, RECV: 2000}  # tid = base + stage (compute) or peer
_ROW_NAMES = {COMPUTE: "stage {} compute", SEND: "send to rank {}", RECV: "recv from rank {}"}


def chrome_trace(events: Timeline | Iterable[Event]) -> dict[str, Any]:
    """The Trace Event Format: complete ('X') events in microseconds, flow events ('s', 'f')
    from each send to its receive, names for every process (rank) and row."""
    events = sorted(_events(events), key=lambda e: e.start)
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append(_meta("process_name", rank, 0, f"rank {rank}"))
        trace.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
    for rank, tid in sorted({(e.rank, _tid(e)) for e in events}):
        trace.append(_meta("thread_name", rank, tid, _row_name(tid)))
        trace.append(_meta("thread_sort_index", rank, tid, tid, key="sort_index"))
    trace.extend(_complete(e, origin) for e in events)
    trace.extend(_flows(events, origin))
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {ORIGIN_KEY: origin}}


def write_chrome_trace(events: Timeline | Iterable[Event], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def events_from_trace(trace: dict[str, Any]) -> list[Event]:
    """The events a `chrome_trace` holds, on the clock of the run that wrote it."""
    origin = trace.get("otherData", {}).get(ORIGIN_KEY, 0.0)
    return [Event(start=origin + e["ts"] / 1e6, duration=e["dur"] / 1e6, **e["args"])
            for e in trace["traceEvents"] if e.get("ph") == "X"]


def merge_traces(traces: Iterable[dict[str, Any] | str | Path]) -> dict[str, Any]:
    """One trace from several ranks' `chrome_trace`s (dicts or files): one process per rank,
    and the arrows between them that no single rank's file can hold."""
    loaded = (t if isinstance(t, dict) else json.loads(Path(t).read_text()) for t in traces)
    return chrome_trace(chain.from_iterable(events_from_trace(t) for t in loaded))


def _events(events: Timeline | Iterable[Event]) -> list[Event]:
    return list(events.events if isinstance(events, Timeline) else events)


def _tid(e: Event) -> int:
    return _ROW_BASE[e.kind] + (e.stage if e.kind == COMPUTE else (e.peer or 0))


def _row_name(tid: int) -> str:
    kind = {base: kind for kind, base in _ROW_BASE.items()}[tid - tid % 1000]
    return _ROW_NAMES[kind].format(tid % 1000)


def _name(e: Event) -> str:
    if e.kind == COMPUTE:
        return f"stage {e.stage} {'whole' if e.whole else f'chunk {e.chunk}'}"
    arrow = "->" if e.kind == SEND else "<-"
    carry = " carry" if e.carry else ""
    return f"{e.kind}{carry} stage {e.stage} chunk {e.chunk} {arrow} rank {e.peer}"


def _complete(e: Event, origin: float) -> dict[str, Any]:
    return {"name": _name(e), "cat": e.kind, "ph": "X", "ts": (e.start - origin) * 1e6,
            "dur": e.duration * 1e6, "pid": e.rank, "tid": _tid(e),
            "args": {"kind": e.kind, "rank": e.rank, "stage": e.stage, "chunk": e.chunk,
                     "step": e.step, "units": e.units, "peer": e.peer, "carry": e.carry,
                     "whole": e.whole}}


def _message(e: Event) -> tuple:
    """What a send and its receive share: sender, receiver, stage, chunk, message step."""
    sender, receiver = (e.rank, e.peer) if e.kind == SEND else (e.peer, e.rank)
    return sender, receiver, e.stage, e.chunk, e.message_step, e.carry


def _flows(events: list[Event], origin: float) -> list[dict[str, Any]]:
    """A flow from the middle of each send to the middle of its receive (both ends bound to
    the slices around them), for the pairs whose two ends are in `events`."""
    receives = {_message(e): e for e in events if e.kind == RECV}
    flows = []
    for e in events:
        recv = receives.get(_message(e)) if e.kind == SEND else None
        if recv is None:
            continue
        flow_id = len(flows) // 2 + 1
        for end, phase in ((e, "s"), (recv, "f")):
            flows.append({"name": "message", "cat": "message", "ph": phase, "id": flow_id,
                          "pid": end.rank, "tid": _tid(end), "bp": "e",
                          "ts": (end.start + end.duration / 2 - origin) * 1e6})
    return flows


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


@dataclass(frozen=True)
class StageTiming:
    """Seconds of one chunk of a stage: the median measured, and the cost model's median
    over the plan's chunks."""

    stage: int
    samples: int
    measured_s: float
    predicted_s: float
    overhead_s: float = 0.0  # of predicted_s: the fixed cost of launching the stage's ops
    chunk_tokens: int = 0

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s else float("inf")

    @property
    def overhead_bound(self) -> bool:
        """More than half the chunk's time is the per-op fixed cost: the chunk is too small
        for this device to do useful work between op launches."""
        return self.overhead_s > 0.5 * self.predicted_s


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
        predicted = [seconds(stage.cost, rates, plan.chunk_tokens(c), plan.context_tokens(c),
                             float(c.segments)) for c in plan.chunks]
        launches = statistics.median(stage.cost.launches_at(float(c.segments))
                                     for c in plan.chunks)
        rows.append(StageTiming(stage.index, len(measured),
                                statistics.median(measured) if measured else float("nan"),
                                statistics.median(predicted),
                                launches * rates.per_op_overhead,
                                plan.chunk_tokens(plan.chunks[0])))
    return rows


def format_comparison(rows: list[StageTiming]) -> str:
    lines = [f"{'stage':>5} {'chunks':>6} {'measured ms':>12} {'predicted ms':>13} "
             f"{'measured/predicted':>19}  bound by"]
    for r in rows:
        bound = "op overhead" if r.overhead_bound else "compute/memory"
        lines.append(f"{r.stage:>5} {r.samples:>6} {r.measured_s * 1e3:>12.3f} "
                     f"{r.predicted_s * 1e3:>13.3f} {r.ratio:>19.2f}  {bound}")
    small = [r for r in rows if r.overhead_bound]
    if small:
        lines.append(
            f"stage(s) {', '.join(str(r.stage) for r in small)}: a chunk of "
            f"{small[0].chunk_tokens} tokens is too small for this device; more than half its "
            "time is the fixed cost of launching each op, which the prediction holds loosely; "
            "use fewer chunks (or Inductor stages, or CUDA graphs on a GPU)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Merge per-rank tokpipe Chrome traces.")
    parser.add_argument("out", type=Path, help="the merged trace to write")
    parser.add_argument("traces", type=Path, nargs="+", help="each rank's trace")
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(merge_traces(args.traces)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
