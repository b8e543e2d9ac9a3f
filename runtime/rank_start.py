"""How `launch` starts its ranks: forked from a warm server, or spawned.

A spawned rank imports torch, Dynamo and tokpipe afresh: 5-7 s of CPU before it runs a line
of the caller's function, paid by every rank of every launch. CPU ranks are instead forked
from multiprocessing's forkserver, started once per launching process with tokpipe (so
torch and Dynamo) imported, and diffusers' models where the launcher uses diffusers; a rank
then starts in about 0.1 s. The server holds those modules' memory (a few hundred MB,
shared with its ranks until written).

Forking is safe there because the server only imports: it runs no torch op, starts no
thread and touches no device. Ranks are still spawned on CUDA (a CUDA runtime must not cross
a fork), where the platform has no forkserver, and when the launcher's environment differs
from the server's in variables that torch, Triton or tokpipe read at import (a forked rank
would see the server's values). Every other variable reaches a forked rank as the launcher
has it now (`rank_environment`).

A forked rank's parent is the server, which outlives the launcher while it has ranks, so
the kernel's parent-death signal cannot end ranks with their launcher. Each rank holds the
read end of a lifeline pipe whose write end only the launcher holds, and a thread that
kills the rank when the pipe reaches end of file: when the launcher ends, however it ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import torch

PRELOAD = ["tokpipe_compiler"]
# Preloaded too when the launcher has imported their package: ranks then likely build
# diffusers models, whose modules take 3-4 s to import.
PRELOAD_IF_USED = {"diffusers": "diffusers.models.transformers"}
# Read when a module is imported, so fixed in the server once it has imported them.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "TOKPIPE", "TRITON", "CUDA", "NCCL", "GLOO", "OMP",
                        "MKL", "KMP")

START_METHODS = ("auto", "spawn")

_server: tuple[int, dict[str, str]] | None = None  # the server's pid and import-time variables


def rank_context(device: str, start: str = "auto") -> tuple[BaseContext, int]:
    """The context that starts ranks on `device`, and the pid their parent will have (the
    launcher when spawned, the server when forked). `start`: "auto" (module docstring),
    or "spawn" for every rank."""
    if start not in START_METHODS:
        raise ValueError(f"launch: start={start!r}; use one of {START_METHODS}")
    if (start == "spawn" or torch.device(device).type != "cpu"
            or "forkserver" not in mp.get_all_start_methods()):
        return mp.get_context("spawn"), os.getpid()
    server = _running_server()
    if server is None or server[1] != _import_time_variables():
        return mp.get_context("spawn"), os.getpid()
    return mp.get_context("forkserver"), server[0]


def rank_environment() -> dict[str, str]:
    """The launcher's environment, for a rank to adopt (a forked one has the server's)."""
    return dict(os.environ)


def adopt_environment(environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)


def _running_server() -> tuple[int, dict[str, str]] | None:
    """The forkserver's pid and the import-time variables it started with, started with
    PRELOAD if it was not running; None where its pid cannot be read."""
    global _server
    used = [module for package, module in PRELOAD_IF_USED.items() if package in sys.modules]
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD + used)
    forkserver.ensure_running()
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return None
    if _server is None or _server[0] != pid:  # a new server: it has this environment
        _server = (pid, _import_time_variables())
    return _server


def _import_time_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def hold_lifeline(lifeline: Connection) -> None:
    """In a rank: end this process when the launcher's end of `lifeline` closes."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):  # end of file: the launcher is gone
            lifeline.recv_bytes()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tokpipe-lifeline", daemon=True).start()
