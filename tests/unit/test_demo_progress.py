"""The demo's progress bar: tqdm on a terminal, silent in a pipe, under CI or --quiet."""

from __future__ import annotations

import io
import sys

import pytest

from tokpipe_compiler import demo

pytest.importorskip("tqdm")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps_through(monkeypatch, stream: io.StringIO, show: bool = True) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    report = demo._bar(3, "pipelined", show)
    for step in range(3):
        report(step)
    return stream.getvalue()


def test_a_terminal_sees_the_bar_complete(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    text = steps_through(monkeypatch, Terminal())
    assert "pipelined" in text and "3/3" in text


@pytest.mark.parametrize(("stream", "ci", "show"), [
    (io.StringIO(), None, True),  # a pipe or a file
    (Terminal(), "true", True),  # CI
    (Terminal(), None, False),  # --quiet, or a rank other than the first
])
def test_quiet_where_nobody_watches(monkeypatch, stream, ci, show):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert steps_through(monkeypatch, stream, show) == ""
