"""Per-rank timelines merged into one Chrome trace: one process per rank, only rows that hold
events, steps counted across calls, whole-sequence steps named, an arrow per send; the JSON
checked against the Trace Event Format."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.inspection.timeline import (
    chrome_trace,
    events_from_trace,
    main,
    merge_traces,
    write_chrome_trace,
)
from tokpipe_compiler.runtime.timeline_events import Event

# The Trace Event Format's phases used here, and the keys each must carry.
REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"},
            "M": {"name", "ph", "pid", "args"},
            "s": {"name", "ph", "ts", "pid", "tid", "id"},
            "f": {"name", "ph", "ts", "pid", "tid", "id"}}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace_event_format(data: dict[str, Any]) -> None:
    """What Perfetto and chrome://tracing need of a JSON trace, and the flows bound to a
    slice at each end."""
    json.loads(json.dumps(data))  # plain JSON
    assert isinstance(data["traceEvents"], list)
    assert data.get("displayTimeUnit", "ms") in {"ms", "ns"}
    slices = defaultdict(list)
    for e in data["traceEvents"]:
        assert e["ph"] in REQUIRED, e
        assert REQUIRED[e["ph"]] <= set(e), e
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int)
        if e["ph"] == "M":
            assert e["name"] in METADATA
        else:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    flows = defaultdict(dict)
    for e in data["traceEvents"]:
        if e["ph"] in "sf":
            assert e["ph"] not in flows[e["id"]], "one start and one finish per flow id"
            flows[e["id"]][e["ph"]] = e
            assert e["ph"] == "s" or e.get("bp") == "e"
            assert any(a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])]), \
                "a flow end bound to no slice"
    assert all(set(ends) == {"s", "f"} for ends in flows.values())


def rows(data: dict[str, Any]) -> tuple[set, set]:
    named = {(e["pid"], e["tid"]) for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in data["traceEvents"] if e["ph"] == "X"}
    return named, used


def check_merged(data: dict[str, Any], world: int) -> None:
    """The merged trace's promises on top of the format."""
    check_trace_event_format(data)
    events = data["traceEvents"]
    processes = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in processes) == list(range(world))
    named, used = rows(data)
    assert named == used  # every row named, no empty row
    for rank in range(world):  # steps never go back on a rank
        steps = [e["args"]["step"] for e in sorted(events, key=lambda e: e.get("ts", 0))
                 if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "compute"]
        assert steps == sorted(steps)
    sends = [e for e in events if e["ph"] == "X" and e["cat"] == "send"]
    assert len([e for e in events if e["ph"] == "s"]) == len(sends) > 0


def two_ranks() -> list[list[Event]]:
    """A warmup call and a chunked call of 2 chunks over 2 ranks, as the ranks record them
    (times in seconds on one clock, far from zero as perf_counter's are)."""
    t0 = 1000.0
    rank0 = [Event("compute", 0, 0, 0, 0, t0, 0.010, 4, whole=True),
             Event("send", 0, 0, 0, 0, t0 + 0.010, 0.001, 4, peer=1, whole=True)]
    rank1 = [Event("recv", 1, 0, 0, 0, t0 + 0.0005, 0.011, 4, peer=0, whole=True),
             Event("compute", 1, 1, 0, 0, t0 + 0.012, 0.010, 4, whole=True)]
    for chunk in range(2):
        at = t0 + 0.03 + 0.006 * chunk
        rank0 += [Event("compute", 0, 0, chunk, 1, at, 0.005, 2),
                  Event("send", 0, 0, chunk, 1, at + 0.005, 0.0005, 2, peer=1)]
        rank1 += [Event("recv", 1, 0, chunk, 1, at + 0.001, 0.0045, 2, peer=0),
                  Event("compute", 1, 1, chunk, 1, at + 0.0056, 0.005, 2)]
    return [rank0, rank1]


def test_merged_files_make_one_trace_with_an_arrow_per_send(tmp_path):
    paths = [write_chrome_trace(events, tmp_path / f"rank{rank}.json")
             for rank, events in enumerate(two_ranks())]
    merged = merge_traces(paths)
    check_merged(merged, world=2)
    assert len([e for e in merged["traceEvents"] if e["ph"] == "s"]) == 3
    names = {e["name"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert {"stage 1 whole", "stage 1 chunk 0", "stage 1 chunk 1"} <= names
    rows_of_rank1 = {e["args"]["name"] for e in merged["traceEvents"]
                     if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert rows_of_rank1 == {"stage 1 compute", "recv from rank 0"}


def test_merging_keeps_the_ranks_on_one_clock(tmp_path):
    per_rank = two_ranks()
    files = [chrome_trace(events) for events in per_rank]  # each file starts at its own 0
    merged = merge_traces(files)
    assert merged == chrome_trace(per_rank[0] + per_rank[1])
    assert events_from_trace(files[1]) == sorted(per_rank[1], key=lambda e: e.start)


def test_the_command_writes_the_merged_trace(tmp_path, capsys):
    paths = [write_chrome_trace(events, tmp_path / f"rank{rank}.json")
             for rank, events in enumerate(two_ranks())]
    assert main([str(tmp_path / "merged.json"), *map(str, paths)]) == 0
    check_merged(json.loads((tmp_path / "merged.json").read_text()), world=2)


def test_a_message_arrow_runs_forward_from_an_early_posted_receive(tmp_path):
    """A receive posted long before its send: the arrow from the middle of one to the
    middle of the other pointed back in time."""
    action = Event("send", 0, 0, 0, 1, 0.030, 0.001, 2, 1)
    posted = Event("recv", 1, 0, 0, 1, 0.0, 0.050, 2, 0)
    flows = [e for e in merge_traces([chrome_trace([action]), chrome_trace([posted])])[
        "traceEvents"] if e["ph"] in "sf"]
    start, finish = (next(e["ts"] for e in flows if e["ph"] == ph) for ph in "sf")
    assert start < finish
    assert 30_000 <= start <= 31_000 and 49_000 <= finish <= 50_000


def test_the_command_will_not_write_over_a_trace_it_merges(tmp_path, capsys):
    paths = [write_chrome_trace(events, tmp_path / f"rank{rank}.json")
             for rank, events in enumerate(two_ranks())]
    before = paths[1].read_text()
    assert main([str(paths[1]), *map(str, paths)]) == 2
    assert "is one of the traces to merge" in capsys.readouterr().err
    assert paths[1].read_text() == before


def test_one_process_trace_has_no_empty_rows_and_counts_steps():
    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    program = traced.program(stages=2, chunks=2, mode="stale")
    for _ in range(3):
        program(*traced.inputs)
    data = chrome_trace(program.timeline)
    check_trace_event_format(data)
    named, used = rows(data)
    assert named == used == {(0, 0), (0, 1)}  # two compute rows, no send/recv rows
    steps = sorted({e["args"]["step"] for e in data["traceEvents"] if e["ph"] == "X"})
    assert steps == [0, 1, 2]
    whole = [e for e in data["traceEvents"] if e["ph"] == "X" and e["args"]["whole"]]
    assert {e["args"]["step"] for e in whole} == {0} and len(whole) == 2


def test_the_command_names_a_missing_file(tmp_path, capsys):
    path = write_chrome_trace(two_ranks()[0], tmp_path / "rank0.json")
    assert main([str(tmp_path / "merged.json"), str(path), str(tmp_path / "nosuch.json")]) == 2
    err = capsys.readouterr().err
    assert "error: No such file or directory" in err and "nosuch.json" in err
    assert "Traceback" not in err and not (tmp_path / "merged.json").exists()


def test_the_command_refuses_a_torch_profiler_trace(tmp_path, capsys):
    """torch.profiler's Chrome trace (tokpipe generate --profile) is not a tokpipe timeline:
    its events' args are not a tokpipe Event's."""
    path = write_chrome_trace(two_ranks()[0], tmp_path / "rank0.json")
    profile = tmp_path / "profile_rank0.json"
    profile.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1,
         "args": {"External id": 3}}]}))
    assert main([str(tmp_path / "merged.json"), str(path), str(profile)]) == 2
    err = capsys.readouterr().err
    assert f"{profile} is not a tokpipe timeline" in err and "torch.profiler" in err
    (tmp_path / "bad.json").write_text("{")
    assert main([str(tmp_path / "merged.json"), str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not JSON" in capsys.readouterr().err


def test_a_rank_given_twice_is_refused(tmp_path, capsys):
    """The same rank's file twice would duplicate every event."""
    ranks = two_ranks()
    paths = [write_chrome_trace(ranks[0], tmp_path / "rank0.json"),
             write_chrome_trace(ranks[1], tmp_path / "rank1.json")]
    assert main([str(tmp_path / "merged.json"), *map(str, paths), str(paths[0])]) == 2
    err = capsys.readouterr().err
    assert "both hold rank 0's events: give each rank's trace once" in err
