"""The benchmark scripts' command lines: a wrong count, name or chunk count is refused when the
arguments are parsed (before a model is built or a serial run is timed), naming the valid
values; --help shows each option's default and the docstring's whole first paragraph. Also
what the scripts print while they run (cpu_pipeline's rows, released_pipelines' table without
progress bars), soak.py's count of leftover processes, and gpu_check.sh without a GPU."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py"))


def script(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


def refusal(name: str, argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The argparse error `name`'s parser gives for `argv`."""
    with pytest.raises(SystemExit) as exit_info:
        script(name).arguments().parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("name", "argv", "says"), [
    ("cpu_pipeline", ["--steps", "0"], "--steps: must be >= 2, got 0"),
    ("cpu_pipeline", ["--steps", "-3"], "--steps: must be >= 2, got -3"),
    ("cpu_pipeline", ["--chunks", "foo"], "--chunks: expected auto or a chunk count >= 1"),
    ("cpu_pipeline", ["--chunks", "4", "0"], "--chunks: expected auto or a chunk count >= 1"),
    ("cost_model", ["--runs", "0"], "--runs: must be >= 1, got 0"),
    ("rank_start", ["--launches", "0"], "--launches: must be >= 1, got 0"),
    ("fidelity", ["--samples", "0"], "--samples: must be >= 2, got 0"),
    ("fidelity", ["--settings", "bogus"], "unknown setting 'bogus'; choose from 'sync, 2 stages"),
    ("pipelines", ["--chunks", "0"], "--chunks: must be >= 1, got 0"),
    ("pipelines", ["--only", "bogus"], "choose from 'per call', 'ring', 'cfg', 'hybrid'"),
    ("pipeline_memory", ["--pipelines", "0"], "--pipelines: must be >= 1, got 0"),
    ("predict_h200", ["not-a-model"], "unknown released config 'not-a-model'; choose from 'aura"),
    ("released_pipelines", ["--names", "nope"], "unknown released config 'nope'"),
    ("released_pipelines", ["--mode", "bogus"], "invalid choice: 'bogus' (choose from 'stale'"),
    ("released_pipelines", ["--compiler", "x"], "invalid choice: 'x' (choose from 'inductor'"),
    ("released_pipelines", ["--chunks", "0"], "--chunks: expected auto or a chunk count >= 1"),
    ("step_callbacks", ["--names", "nope"], "unknown released config 'nope'"),
    ("compile_cache", ["--name", "nope"], "unknown released config 'nope'"),
    ("compile_cache", ["--warm-runs", "0"], "--warm-runs: must be >= 1, got 0"),
    ("soak", ["--ring-steps", "25", "0"], "--ring-steps: must be >= 1, got 0"),
    ("soak", ["--generations", "0"], "--generations: must be >= 1, got 0"),
    ("text_fidelity", ["notapipe"], "unknown pipeline 'notapipe'; choose from"),
    ("gpu_pipeline", ["--steps", "1"], "--steps: must be >= 2, got 1"),
    ("gpu_pipeline", ["--chunks", "0"], "--chunks: expected auto or a chunk count >= 1"),
    ("first_chunk", ["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ("chunk_cost", ["--calls", "x"], "--calls: expected a whole number, got 'x'"),
    ("text_chunks", ["--reps", "0"], "--reps: must be >= 1, got 0"),
    ("host_overhead", ["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ("overhead", ["--chunks", "1", "0"], "--chunks: must be >= 1, got 0"),
    ("gpu_rates", ["--reps", "0"], "--reps: must be >= 1, got 0"),
])
def test_a_bad_argument_is_refused_when_parsed(name, argv, says, capsys):
    assert says in refusal(name, argv, capsys)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_has_the_whole_first_paragraph_and_every_default(name):
    module = script(name)
    parser = module.arguments()
    first = " ".join(module.__doc__.strip().split("\n\n")[0].split())
    assert parser.description == first
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings:
            assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False, argparse.SUPPRESS) and action.help:
            assert "(default: " in formatter._get_help_string(action), action.option_strings
    parser.parse_args([])  # the defaults pass their own checks


def test_defaults_are_shown_as_typed(capsys):
    assert "(default: 2 4 8 auto)" in " ".join(script("cpu_pipeline").arguments()
                                               .format_help().split())
    assert script("cpu_pipeline").arguments().parse_args([]).chunks == [2, 4, 8, "auto"]


def test_only_names_every_competitor_pipelines_runs():
    pipelines = script("pipelines")
    args = pipelines.arguments().parse_args(["--only", "per call", "ring"])
    assert args.only == ["per call", "ring"]
    assert tuple(pipelines.competitors(args)) == pipelines.COMPETITORS


def test_fidelity_settings_parse_to_names():
    fidelity = script("fidelity")
    assert fidelity.arguments().parse_args([]).settings == list(fidelity.SETTINGS)
    first, second = list(fidelity.SETTINGS)[:2]
    args = fidelity.arguments().parse_args(["--settings", f"{first};{second}"])
    assert args.settings == [first, second]


def test_cpu_pipeline_prints_each_row_as_it_finishes(monkeypatch, capsys):
    """Each serial run and each launch sees the rows before it already printed, and the
    table keeps its columns under a label longer than the others."""
    cpu_pipeline = script("cpu_pipeline")
    before: list[str] = []
    parts = {"compute": 1.0, "recv": 0.1, "send": 0.01, "per_chunk_ms": 60.0}

    def serial(shape, steps, threads, inductor):
        before.append(capsys.readouterr().out)
        return 10.0 / threads

    def launch(fn, ranks, timeout, args):
        before.append(capsys.readouterr().out)
        return [{"seconds": 4.0, "breakdown": parts if args[3] else None, "chunks": 8}] * 2

    monkeypatch.setattr(cpu_pipeline, "serial", serial)
    monkeypatch.setattr(cpu_pipeline, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["cpu_pipeline.py", "--chunks", "auto"])
    cpu_pipeline.main()
    assert "serial eager, 1 thread: 10.00 s, 1.00x" in before[1]
    assert "serial inductor, 2 threads: 5.00 s, 2.00x" in before[3]
    assert "tokpipe per-call, chunks auto (8): 4.00 s, 2.50x" in before[4]
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    end = table[0].index("time s") + len("time s")
    for line in table[1:]:
        assert line[end - 1].isdigit() and line[end] == " ", line


def test_released_pipelines_prints_its_table_whole(monkeypatch, capsys):
    """What the ranks print while a model runs comes before the table, not between its rows."""
    released_pipelines = script("released_pipelines")

    def launch(fn, ranks, args, timeout):
        print("pipelined: a first call traces, plans and compiles the stages")
        return [{"chunks": [4], "made_while_timed": False, "serial_s": 2.0,
                 "pipelined_s": 1.0, "difference": 1e-4}] * 2

    monkeypatch.setattr(released_pipelines, "launch", launch)
    released_pipelines.main(["--names", "pixart-sigma-xl-2-1024-ms", "sd3-medium",
                             "--chunks", "4"])
    out = capsys.readouterr().out
    assert "pixart-sigma-xl-2-1024-ms: serial 2.00 s, ring 1.00 s, 2.00x" in out
    table = out.split("\n\n")[-1].splitlines()
    assert table[1].startswith("model") and table[2].startswith("pixart-sigma-xl-2-1024-ms")
    assert table[3].startswith("sd3-medium") and table[4].startswith("chunks:")


def test_released_pipelines_ranks_show_no_progress_bars():
    """Rank 0's pipeline gets its bars off (diffusers passes disable=False there explicitly,
    which TQDM_DISABLE does not override): the script runs `tokpipe generate --quiet`."""
    released_pipelines = script("released_pipelines")
    assert "--quiet" in inspect.getsource(released_pipelines.measure)


def test_generate_quiet_turns_the_pipelines_bars_off(monkeypatch):
    from tokpipe_compiler import generate
    from tokpipe_compiler.cli import _parser

    seen = {}

    def stop(pipe, *args):  # the first thing run does with the loaded pipeline
        seen["disabled"] = pipe.progress_bar(range(1)).disable
        raise StopIteration

    for argv, disabled in ((["--quiet"], True), ([], False)):
        options = _parser().parse_args(["generate", "--tiny", "dit", "--device", "cpu", *argv])
        monkeypatch.setattr(generate, "to_device", stop)
        with pytest.raises(StopIteration):
            generate._run(0, options, None)
        assert seen["disabled"] is disabled


def test_soak_counts_a_forked_rank_left_over_but_not_the_warm_server():
    """`launch` forks CPU ranks from multiprocessing's forkserver, a child of the launcher
    that outlives each launch (tokpipe_compiler/runtime/rank_start.py)."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    soak = script("soak")
    started = forkserver._forkserver._forkserver_pid is None
    forkserver.ensure_running()
    server = forkserver._forkserver._forkserver_pid
    rank = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    rank.start()
    try:
        left = {int(line.split(":")[0]) for line in soak.leftover_processes()}
    finally:
        rank.kill()
        rank.join()
        if started:  # a later `launch` starts its own, with its modules preloaded
            forkserver._forkserver._stop()
    assert rank.pid in left
    assert server not in left


def gpu_check(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_gpu_check_help_prints_its_usage():
    done = gpu_check("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: ")
    done = gpu_check("--quick")
    assert done.returncode == 2 and "takes no arguments, got: --quick" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="it would run the GPU check")
def test_gpu_check_without_a_gpu_writes_nothing(tmp_path):
    done = gpu_check(env={"REPORT_DIR": str(tmp_path / "report")})
    assert done.returncode == 1 and "no CUDA GPU here" in done.stderr
    assert not (tmp_path / "report").exists()
