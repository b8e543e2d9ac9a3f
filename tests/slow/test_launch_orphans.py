"""Ranks started by launch() end with the process that launched them, even when it is
killed outright; so does every other process it started (the fork server that CPU ranks are
forked from, multiprocessing's resource tracker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ranks,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = """
import sys
from tokpipe_compiler.runtime.launch import launch
from tests.slow.test_launch_orphans import pid_rank
launch(pid_rank, 2, args=(sys.argv[1],), timeout=600)
"""


def pid_rank(rank: int, world: int, folder: str) -> None:
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent has yet to reap it


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    return found


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_ranks_end_when_their_launcher_is_killed(tmp_path, how):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=ROOT)
    pids: list[int] = []
    try:
        files = [tmp_path / f"{rank}.pid" for rank in range(2)]
        assert wait_for(lambda: all(f.exists() and f.read_text() for f in files), 120)
        ranks = [int(f.read_text()) for f in files]
        pids = descendants(launcher.pid)
        assert set(ranks) <= set(pids) and all(map(alive, ranks))
        launcher.send_signal(how)
        launcher.wait(30)
        assert wait_for(lambda: not any(map(alive, ranks)), 10), "ranks outlived their launcher"
        assert wait_for(lambda: not any(map(alive, pids)), 10), "a process outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
