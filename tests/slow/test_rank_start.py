"""How launch() starts ranks (`runtime/rank_start.py`): CPU ranks forked from a server that
has tokpipe imported, with the launcher's environment as it is at the launch; spawned where
forking would hand them stale import-time settings, and on CUDA."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tokpipe_compiler.runtime import rank_start
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks,
              pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(),
                                 reason="no forkserver on this platform")]


def started(rank: int, world: int, name: str) -> tuple[int, str | None]:
    """This rank's parent and its value of the variable `name`."""
    return os.getppid(), os.environ.get(name)


def test_cpu_ranks_are_forked_and_see_the_environment_of_the_launch(monkeypatch):
    launch(started, 1, args=("X",), timeout=120)  # the server is running from here on
    monkeypatch.setenv("RANK_START_PROBE", "set after the server started")
    for parent, value in launch(started, 2, args=("RANK_START_PROBE",), timeout=120):
        assert parent != os.getpid()  # forked by the server, not spawned by this process
        assert value == "set after the server started"


def test_a_changed_import_time_variable_spawns_the_ranks(monkeypatch):
    """A rank forked from the server would hold the server's value of a variable read at
    import; with it changed since the server started, the ranks are spawned afresh."""
    launch(started, 1, args=("X",), timeout=120)
    monkeypatch.setenv("TOKPIPE_RANK_START_PROBE", "1")
    for parent, value in launch(started, 2, args=("TOKPIPE_RANK_START_PROBE",),
                                   timeout=120):
        assert parent == os.getpid() and value == "1"


def test_cuda_ranks_are_spawned():
    context, parent = rank_start.rank_context("cuda")
    assert context.get_start_method() == "spawn" and parent == os.getpid()


def test_spawn_can_be_asked_for_and_an_unknown_start_is_refused():
    context, parent = rank_start.rank_context("cpu", "spawn")
    assert context.get_start_method() == "spawn" and parent == os.getpid()
    with pytest.raises(ValueError, match="start='fork'; use one of"):
        launch(started, 1, args=("X",), start="fork")
