"""A real run's timeline: as a Chrome trace, merged across ranks, and measured against
predicted per stage.

A timeline holds what the executor ran: each chunk's (or whole step's) compute, each send
and each receive, a ring's carries among them. Receives are posted ahead, so a receive's
time is the rank's wait for its values (there is no separate wait event). The prelude and the
broadcast of the output to every rank are not recorded.

    program = tokpipe_compiler.programs(compiled)[0]                # after a few calls
    write_chrome_trace(program.timeline, "trace.json")       # ui.perfetto.dev, chrome://tracing
    print(format_comparison(compare(program.plan, program.timeline),
                            program.plan.config.compiler))

The comparison covers the stages the timeline ran (on a rank, its own) and times each over its
steady steps (`steady_steps`): not the steps that compile, nor those just after.

Under torch.distributed each rank writes its own file; one command merges them:

    write_chrome_trace(program.timeline, f"trace{rank}.json")     # on every rank
    python -m tokpipe_compiler.inspection.timeline merged.json trace0.json trace1.json

Each rank is a process; its rows are each stage's computes, its sends to each rank and its
receives from each rank (only rows that hold events). Steps count across calls; computes of a
whole-sequence step (warmup, sync mode) are named `whole`; an arrow (flow event) joins each
send to its receive. Ranks on one machine share one clock (time.perf_counter is system-wide
there), which each file keeps (`otherData.tokpipe_origin_s`) so that merging lines them up.
Merging refuses a file that is not such a trace (a torch.profiler trace, say) and two files
holding the same rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokpipe_compiler.runtime.timeline_events import Event, Timeline

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
    and the arrows between them that no single rank's file can hold. Raises ValueError on a
    file that is not a tokpipe timeline and on two traces that hold the same rank."""
    by_source = [(source, events_from_trace(_tokpipe_trace(source))) for source in traces]
    seen: dict[int, str] = {}
    for source, events in by_source:
        for rank in sorted({e.rank for e in events}):
            if rank in seen:
                raise ValueError(f"{seen[rank]} and {_label(source)} both hold rank {rank}'s "
                                 "events: give each rank's trace once")
            seen[rank] = _label(source)
    return chrome_trace(chain.from_iterable(events for _, events in by_source))


def _tokpipe_trace(source: dict[str, Any] | str | Path) -> dict[str, Any]:
    """The trace `source` holds, checked to be one `chrome_trace` wrote."""
    try:
        trace = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{_label(source)} is not JSON ({err})") from None
    if not (isinstance(trace, dict) and ORIGIN_KEY in trace.get("otherData", {})):
        profiler = isinstance(trace, dict) and "traceEvents" in trace
        raise ValueError(
            f"{_label(source)} is not a tokpipe timeline (write_chrome_trace's file)"
            + ("; it looks like another tool's Chrome trace, such as torch.profiler's "
               "(tokpipe generate --profile), which opens in ui.perfetto.dev as it is"
               if profiler else ""))
    return trace


def _label(source: dict[str, Any] | str | Path) -> str:
    return "a trace given as a dict" if isinstance(source, dict) else str(source)


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
    """A flow from the start of each send to the end of its receive, when the values had
    come (a receive is posted ahead: its middle may lie before the send), both ends just
    inside the slices they bind to, for the pairs whose two ends are in `events`."""
    receives = {_message(e): e for e in events if e.kind == RECV}
    flows = []
    for e in events:
        recv = receives.get(_message(e)) if e.kind == SEND else None
        if recv is None:
            continue
        flow_id = len(flows) // 2 + 1
        for end, phase, at in ((e, "s", 0.01), (recv, "f", 0.99)):
            flows.append({"name": "message", "cat": "message", "ph": phase, "id": flow_id,
                          "pid": end.rank, "tid": _tid(end), "bp": "e",
                          "ts": (end.start + end.duration * at - origin) * 1e6})
    return flows


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


# A stage's measured figure is a median over at least this many steady steps (`steady_steps`).
MIN_STEADY_STEPS = 2


@dataclass(frozen=True)
class StageTiming:
    """Seconds of one chunk of a stage: the median measured over its steady steps (NaN when
    it ran too few of them), and the cost model's median over the plan's chunks."""

    stage: int
    samples: int
    measured_s: float
    predicted_s: float
    overhead_s: float = 0.0  # of predicted_s: the fixed cost of launching the stage's ops
    chunk_tokens: int = 0
    steps: tuple[int, ...] = ()  # the steps measured, counted across calls
    steps_short: int = 0  # more chunked steps the stage must run to be measured
    whole: bool = False  # the plan runs every step whole, one chunk (sync mode)

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s else float("inf")

    @property
    def overhead_bound(self) -> bool:
        """More than half the chunk's time is the per-op fixed cost: the chunk is too small
        for this device to do useful work between op launches. Measured: the time beyond the
        predicted compute and memory time (calibrated per op on a bare loop, the fixed cost
        is far below an eager stage's, which dispatches through Python and the module
        machinery); else the prediction's own share."""
        if self.steps_short or self.measured_s != self.measured_s:  # NaN: not measured
            return self.overhead_s > 0.5 * self.predicted_s
        compute = self.predicted_s - self.overhead_s
        return self.measured_s - compute > 0.5 * self.measured_s


def steady_steps(computes: Iterable[Event]) -> tuple[list[int], int]:
    """The steps that time one stage's chunks steadily (none while fewer than
    MIN_STEADY_STEPS), and how many more chunked steps it must run to have enough.

    Each chunk length's first step compiles (Inductor) or warms up, and the steps just after
    a compile still run slow (the compiler's worker processes start beside them, seconds on
    a few cores), so: the later half of the steps after the first of each chunk length.
    """
    lengths: dict[int, set[int]] = defaultdict(set)
    for e in computes:
        lengths[e.step].add(e.units)
    first: dict[int, int] = {}
    for step in sorted(lengths):
        for units in lengths[step]:
            first.setdefault(units, step)
    settled = [s for s in sorted(lengths) if all(first[u] < s for u in lengths[s])]
    needed = 2 * MIN_STEADY_STEPS - 1  # settled steps whose later half is enough
    short = max(0, needed - len(settled)) + int(not lengths)  # + a first step
    return ([] if short else settled[len(settled) // 2:]), short


def compare(plan: Plan, events: Timeline | Iterable[Event],
            rates: DeviceRates | None = None) -> list[StageTiming]:
    """Measured compute per chunk against the prediction, for each stage the timeline ran
    (a rank's: its own). Measured: the median chunk of the stage's `steady_steps`; warmup
    calls (whole sequence) are left out when the plan has several chunks. `rates`: the
    device's (default: the local CPU's, measured once and cached)."""
    from tokpipe_compiler.costmodel.calibrate import load_or_measure, seconds

    rates = rates or load_or_measure("cpu")
    events = _events(events)
    ran = {e.stage for e in events if e.kind == COMPUTE}
    chunked = [e for e in events if e.kind == COMPUTE
               and (len(plan.chunks) == 1 or e.units != plan.units)]
    rows = []
    for stage in (s for s in plan.stages if s.index in ran):
        computes = [e for e in chunked if e.stage == stage.index]
        steps, short = steady_steps(computes)
        kept = set(steps)
        measured = [e.duration for e in computes if e.step in kept]
        predicted = [seconds(stage.cost, rates, plan.chunk_tokens(c), plan.context_tokens(c),
                             float(c.segments)) for c in plan.chunks]
        launches = statistics.median(stage.cost.launches_at(float(c.segments))
                                     for c in plan.chunks)
        rows.append(StageTiming(stage.index, len(measured),
                                statistics.median(measured) if measured else float("nan"),
                                statistics.median(predicted),
                                launches * rates.per_op_overhead,
                                plan.chunk_tokens(plan.chunks[0]), tuple(steps), short,
                                len(plan.chunks) == 1))
    return rows


# measured over predicted beyond which op launches alone rarely account for a chunk's time
CONTENDED_RATIO = 50


def format_comparison(rows: list[StageTiming], compiler: str = "eager") -> str:
    """The table of `rows` and what it shows; `compiler`: the stages' (the advice for
    op-overhead-bound chunks names Inductor only for eager stages)."""
    if not rows:
        return "no stage computed anything in this timeline: nothing to compare"
    lines = [f"{'stage':>5} {'steps':>8} {'chunks':>6} {'measured ms':>12} "
             f"{'predicted ms':>13} {'measured/predicted':>19}  bound by"]
    for r in rows:
        bound = "op overhead" if r.overhead_bound else "compute/memory"
        measured, ratio = ((f"{r.measured_s * 1e3:.3f}", f"{r.ratio:.2f}") if not r.steps_short
                           else ("-", "-"))
        lines.append(f"{r.stage:>5} {_step_ranges(r.steps) or '-':>8} {r.samples:>6} "
                     f"{measured:>12} {r.predicted_s * 1e3:>13.3f} {ratio:>19}  {bound}")
    whole = rows[0].whole
    lines.append("measured: the median " + ("step" if whole else "chunk") + " over the steps "
                 "shown (counted across calls); left out: " + ("" if whole else
                 "whole-sequence warmup steps, each chunk length's first chunked step") +
                 ("the first step" if whole else "") + " (it compiles) and the first half of "
                 "the steps after it (they still run slow)")
    short = [r for r in rows if r.steps_short]
    if short:
        lines.append(
            f"stage(s) {_stage_list(short)}: too few steps to measure (a figure needs "
            f"{MIN_STEADY_STEPS} steady steps): run at least "
            f"{max(r.steps_short for r in short)} more chunked step(s) (tokpipe inspect: a "
            "larger --run)")
    small = [r for r in rows if r.overhead_bound]
    if small:
        what = "a whole step" if whole else "a chunk"
        remedies = [] if whole else ["fewer chunks"]
        remedies += ["Inductor stages"] * (compiler == "eager") + ["CUDA graphs on a GPU"]
        if whole:
            remedies.append("fewer stages")
        lines.append(
            f"stage(s) {_stage_list(small)}: {what} of {small[0].chunk_tokens} tokens is "
            "too small for this device; more than half its time is the fixed cost of "
            "launching each op (beyond the predicted compute and memory time), which the "
            f"prediction holds loosely; use {', or '.join(remedies)}")
    far = [r for r in small if not r.steps_short and r.ratio > CONTENDED_RATIO]
    if far:
        lines.append(
            f"stage(s) {_stage_list(far)}: measured more than {CONTENDED_RATIO}x the "
            "prediction, which, on a CPU, other work on its cores or more threads than free "
            "cores gives as well: run again with --threads 1 (or on idle cores) before acting "
            "on it")
    return "\n".join(lines)


def _stage_list(rows: list[StageTiming]) -> str:
    return ", ".join(str(r.stage) for r in rows)


def _step_ranges(steps: Iterable[int]) -> str:
    """`3-5,8` for steps 3, 4, 5 and 8."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokpipe_compiler.inspection.timeline",
                                     description="Merge per-rank tokpipe Chrome traces.")
    parser.add_argument("out", type=Path, help="the merged trace to write")
    parser.add_argument("traces", type=Path, nargs="+",
                        help="each rank's trace (write_chrome_trace's file), once")
    args = parser.parse_args(argv)
    if any(args.out.resolve() == trace.resolve() for trace in args.traces):
        print(f"{parser.prog}: error: the merged trace {args.out} is one of the traces to "
              "merge; name another file", file=sys.stderr)
        return 2
    try:
        args.out.write_text(json.dumps(merge_traces(args.traces)))
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a missing trace, an unwritable out
        print(f"{parser.prog}: error: {err.strerror or err}: {err.filename or ''}",
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
