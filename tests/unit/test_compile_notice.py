"""A slow stage compile explains, at length once per process, why a first call at a new
shape takes long, then says so in a line for each later run of compiles
(stage_programs/compile.py); eager stages and quick compiles say nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from tokpipe_compiler.stage_programs import compile as stage_compile


@pytest.fixture
def slow_compiles(monkeypatch):
    """Every compile counts as slow, and returns the graph as is (no Inductor run)."""
    monkeypatch.setattr(stage_compile, "SLOW_COMPILE_S", 0.0)
    monkeypatch.setattr(stage_compile, "_notes", stage_compile._Notes())
    monkeypatch.setattr(stage_compile, "compile_stage", lambda gm, inputs, compiler: gm)


def _graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.Linear(2, 2))


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_first_slow_compile_says_why_a_first_call_is_slow_once(slow_compiles, caplog):
    with caplog.at_level(logging.INFO, logger="tokpipe_compiler"):
        for units in (4, 8):
            stage_compile.compile_named(f"stage 1's graph for chunks of {units} token rows",
                                        _graph(), [torch.randn(1, 2)], "inductor")
    said = _notices(caplog)
    assert len(said) == 1
    assert said[0].startswith("tokpipe: compiling with Inductor: stage 1's graph for "
                              "chunks of 4 token rows took 0 s (a process's first Inductor "
                              "compile includes Inductor's own start-up")
    assert "this call goes on compiling the stages" in said[0]
    assert "first call at a new shape" in said[0] and "compiler='eager'" in said[0]
    timed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled ")]
    assert len(timed) == 2  # every compile is logged at INFO with its time


def test_a_later_run_of_slow_compiles_says_so_in_a_line(slow_compiles, caplog):
    """A second image at a new size compiled for 18 s without a word."""
    with caplog.at_level(logging.WARNING, logger="tokpipe_compiler"):
        stage_compile.compile_named("stage 0's graph", _graph(), [], "inductor")
        for later in ("stage 0's graph for chunks of 8 token rows", "stage 1's graph"):
            stage_compile._notes.last_end -= stage_compile.PAUSE_S + 1  # a pause before
            for _ in range(2):  # a run of two compiles: one line
                stage_compile.compile_named(later, _graph(), [], "inductor")
    said = _notices(caplog)
    assert len(said) == 3, said
    assert said[1] == ("tokpipe: compiling with Inductor: stage 0's graph for chunks of 8 "
                       "token rows took 0 s (a first call at a new input shape or chunk "
                       "length); this call goes on compiling the stages it needs")
    assert said[2].startswith("tokpipe: compiling with Inductor: stage 1's graph took 0 s")


def test_eager_stages_say_nothing(slow_compiles, caplog):
    gm = _graph()
    with caplog.at_level(logging.INFO, logger="tokpipe_compiler"):
        assert stage_compile.compile_named("stage 0", gm, [], "eager") is gm
    assert not caplog.records


def test_a_quick_compile_says_nothing_by_default(slow_compiles, monkeypatch, caplog):
    monkeypatch.setattr(stage_compile, "SLOW_COMPILE_S", 3600.0)
    with caplog.at_level(logging.WARNING, logger="tokpipe_compiler"):
        stage_compile.compile_named("stage 0", _graph(), [], "inductor")
    assert not caplog.records


def test_the_notice_is_written_between_the_progress_bars(slow_compiles, monkeypatch, caplog):
    """Printed while the ring's bar is drawn, it was glued to the bar's line."""
    import contextlib

    from tqdm import tqdm

    entered = []

    @contextlib.contextmanager
    def clears_the_bars(file=None, nolock=False):
        entered.append(file)
        yield

    monkeypatch.setattr(tqdm, "external_write_mode", clears_the_bars)
    with caplog.at_level(logging.WARNING, logger="tokpipe_compiler"):
        stage_compile.compile_named("stage 0", _graph(), [torch.randn(1, 2)], "inductor")
    assert len(_notices(caplog)) == 1 and len(entered) == 1
