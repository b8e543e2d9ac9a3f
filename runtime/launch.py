"""Run a function on N local ranks without torchrun, and supervise them.

Every wait has a deadline: a rank that raises, dies or stalls becomes one TokpipeError in the
caller that carries each failed rank's traceback (a TokpipeError's message only; ranks that
failed alike once), and the other ranks are terminated. Ranks die with the process that
launched them, however it ends (killed included), as torchrun's do: no orphan keeps a port
or a device.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.process_group import init_process_group_from_env
from tokpipe_compiler.runtime.rank_start import (
    adopt_environment,
    hold_lifeline,
    rank_context,
    rank_environment,
)

# After the first failure, how long the other ranks get to report theirs: a rank blocked on
# a dead peer usually fails within a second, and its message says what it was waiting for.
_GRACE_S = 3.0
_JOIN_S = 5.0  # bound on a rank exiting once it reported, or once terminated


@dataclass
class _Outcome:
    ok: bool
    payload: Any  # the return value, or the error text
    at: float


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 300.0,
    device: torch.device | str = "cpu",
    threads_per_rank: int = 1,
    start: str = "auto",
) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` processes; results in rank order.
    `start`: "auto" forks CPU ranks from a server with tokpipe imported and spawns others
    (`rank_start`); "spawn" spawns every rank.

    Each rank gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK on 127.0.0.1, a
    process group (NCCL for a CUDA `device`, gloo otherwise) and `threads_per_rank` threads.
    Raises TokpipeError if a rank fails or the run exceeds `timeout` seconds.
    """
    if world_size < 1:
        raise TokpipeError(f"launch: world_size must be at least 1, got {world_size}")
    _check_picklable(fn, args)
    ctx, parent_pid = rank_context(str(device), start)
    environment = rank_environment()
    port = _free_port()
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    outcomes: dict[int, _Outcome] = {}
    lifeline, lifeline_held = ctx.Pipe(duplex=False)  # the ranks read, this process holds
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            config = (rank, world_size, port, str(device), threads_per_rank, parent_pid,
                      environment)
            proc = ctx.Process(target=_run_rank, args=(fn, args, config, child, lifeline))
            proc.start()
            child.close()  # so that EOF on `parent` means the rank is gone
            procs.append(proc)
            conns.append(parent)
        _supervise(procs, conns, time.monotonic() + timeout, outcomes)
    finally:
        _stop(procs, outcomes)
        lifeline.close()
        lifeline_held.close()
    return _results(outcomes, world_size, timeout)


def _run_rank(fn: Callable[..., Any], args: tuple, config: tuple, conn: Connection,
              lifeline: Connection) -> None:
    rank, world_size, port, device, threads, parent, environment = config
    _die_with(parent)
    hold_lifeline(lifeline)
    adopt_environment(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        init_process_group_from_env(device)
        value = fn(rank, world_size, *args)
        # Only after success: tearing down after a failure can block on a broken peer.
        dist.destroy_process_group()
        # Plain pickle: multiprocessing's would share tensors through this process's memory,
        # which is gone by the time the parent unpickles them.
        conn.send_bytes(pickle.dumps((True, value)))
    except BaseException as error:
        conn.send_bytes(pickle.dumps((False, failure_text(error))))
    finally:
        conn.close()


def failure_text(error: BaseException) -> str:
    """What a rank reports of the error it raised (while it is handled): the traceback, but
    of a TokpipeError, whose message names what is wrong and what to do, the message."""
    if isinstance(error, TokpipeError):
        return f"TokpipeError: {error}"
    return traceback.format_exc()


def _die_with(parent: int) -> None:
    """This rank gets SIGKILL when its parent ends: the launcher, or the fork server, which
    ends with the launcher (Linux; torch's own spawn does the same with SIGINT, which a rank
    blocked in a backend wait would not act on)."""
    set_death_signal = getattr(torch.multiprocessing, "_prctl_pr_set_pdeathsig", None)
    if set_death_signal is None:  # not Linux: the supervisor's own teardown must do
        return
    set_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)


def _supervise(
    procs: list[BaseProcess],
    conns: list[Connection],
    deadline: float,
    outcomes: dict[int, _Outcome],
) -> None:
    """Fills `outcomes` with the ranks that report before the deadline, or before the grace
    period after the first failure ends."""
    while len(outcomes) < len(procs):
        failed = [o.at for o in outcomes.values() if not o.ok]
        if failed:
            deadline = min(deadline, min(failed) + _GRACE_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waiting = [conn for rank, conn in enumerate(conns) if rank not in outcomes]
        for conn in wait(waiting, timeout=remaining):
            rank = conns.index(conn)
            outcomes[rank] = _receive(conn, procs[rank])


def _receive(conn: Connection, proc: BaseProcess) -> _Outcome:
    try:
        ok, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the pipe closed without a message: the rank died
        proc.join(_JOIN_S)
        ok, payload = False, f"exited with code {proc.exitcode} without returning or raising"
        payload += " (its own output, on stderr, may say why)"
    except Exception:
        ok, payload = False, f"its result could not be unpickled:\n{traceback.format_exc()}"
    return _Outcome(ok, payload, time.monotonic())


def _stop(procs: list[BaseProcess], outcomes: dict[int, _Outcome]) -> None:
    """Ends every rank: those that reported exit on their own, the rest are terminated,
    then killed."""
    deadline = time.monotonic() + _JOIN_S
    for rank in outcomes:
        procs[rank].join(max(deadline - time.monotonic(), 0))
    for stop in ("terminate", "kill"):
        alive = [proc for proc in procs if proc.is_alive()]
        for proc in alive:
            getattr(proc, stop)()
        for proc in alive:
            proc.join(_JOIN_S)


def _results(outcomes: dict[int, _Outcome], world_size: int, timeout: float) -> list[Any]:
    if len(outcomes) == world_size and all(o.ok for o in outcomes.values()):
        return [outcomes[rank].payload for rank in range(world_size)]
    raise TokpipeError(_failure_report(outcomes, world_size, timeout))


def _failure_report(outcomes: dict[int, _Outcome], world_size: int, timeout: float) -> str:
    failed = sorted(rank for rank, o in outcomes.items() if not o.ok)
    running = [rank for rank in range(world_size) if rank not in outcomes]
    if failed:
        lines = [f"launch: rank(s) {_ranks(failed)} of {world_size} failed."]
    else:
        lines = [f"launch: timed out after {timeout:g} s."]
    if running:
        lines.append(f"Rank(s) {_ranks(running)} still running were terminated.")
    reports: dict[str, list[int]] = {}  # ranks that failed alike are reported once
    for rank in failed:
        reports.setdefault(outcomes[rank].payload.rstrip(), []).append(rank)
    lines += [f"\n--- rank {_ranks(ranks)} ---\n{report}" for report, ranks in reports.items()]
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _check_picklable(fn: Callable[..., Any], args: tuple) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    advice = (
        "fn must be a module-level function of an importable module or script (not a "
        "lambda, closure, nested function, or one defined interactively) and args must be "
        "picklable: spawned ranks import fn by name."
    )
    # An interactive __main__ pickles fine here but cannot be imported by a spawned rank.
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(
        sys.modules["__main__"], "__file__"
    ):
        raise TokpipeError(f"launch: {name!r} is defined interactively. {advice}")
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TokpipeError(
            f"launch: cannot send {name!r} and its args to the ranks ({e}). {advice}"
        ) from e


def _free_port() -> int:
    # Another process may take the port before rank 0 binds it; rare on one machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
