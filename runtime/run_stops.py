"""A run that one rank cannot finish ends on every rank at once, and the group lives on.

A rank whose step raises (an out-of-memory, a cancel) would leave its peers waiting
`timeout` for messages it never sends, after which gloo closes the group for good. So it
says so in the process group's store, one key per run, and runs the rest of its schedule
hollow (`Executor`): it posts its receives and sends zeros of each message's shape, and
computes nothing. Its peers look for the key at each of a ring's step ends and at the end
of the run, once its outputs are shared: they run the rest hollow too and raise
`PeerStopped`. Every message of the run is matched, so the group carries the next run.

Runs are numbered per group, alike on every rank: every rank runs its stage of each
program's call over the group, in one order. Groups that run one schedule side by side
(a hybrid cfg=2 ring's two branches) share their keys (`share_stops`): a run stopped in
one stops in the other.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import signal
import threading
import weakref
from typing import Any

import torch.distributed as dist

from tokpipe_compiler.core.errors import PeerStopped

_PREFIX = "tokpipe/stopped/"
# group -> the key scope it shares with groups running the same schedule (`share_stops`)
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_scopes = itertools.count()  # one per `share_stops` call, numbered alike on every rank


def share_stops(groups: list[Any]) -> None:
    """Runs over any of `groups`, which run the same schedule side by side, stop together:
    their stop keys go to the world's store, under a scope of their own (so that other
    pipelines' groups do not read them). Called on every rank in one order, as the groups
    are made (`groups` as `new_group` returned them, on every rank)."""
    scope = f"shared{next(_scopes)}"
    for group in groups:
        if isinstance(group, dist.ProcessGroup):  # not new_group's stand-in for a non-member
            _SHARED[group] = scope


def group_store(group: Any) -> Any:
    """`group`'s store (None where torch does not expose it, or it is out of reach)."""
    store_of = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    try:
        return None if store_of is None else store_of(group)
    except (RuntimeError, ValueError, KeyError):
        return None


class RunStops:
    """The stop keys of one process group's runs, in its store. The group is held weakly
    and its store looked up at each use: a store held past `destroy_process_group` would
    serve its old keys to a group started anew on its port (`links.py`)."""

    def __init__(self, group: Any):
        self._group = weakref.ref(group)
        self.runs = 0  # runs begun over the group by this rank
        scope = _SHARED.get(group)
        self._prefix = _PREFIX if scope is None else f"{_PREFIX}{scope}/"
        self._in_world = scope is not None  # keys in the world's store, not the group's
        # the group whose store lost its connection (its host, rank 0, gone): each further
        # call would fail alike, and c10d logs every failure with a C++ backtrace
        self._lost: weakref.ref | None = None

    def _holder(self) -> Any:
        """The group whose store holds the keys (None: the group is gone)."""
        return dist.GroupMember.WORLD if self._in_world and self._group() is not None \
            else self._group()

    def _store(self) -> Any:
        """The group's store (None: the group is gone, its store out of reach, or torch
        does not expose it)."""
        holder = self._holder()
        if holder is None or (self._lost is not None and self._lost() is holder):
            return None
        return group_store(holder)

    def _failed(self, error: BaseException) -> None:
        """A store call failed: where its connection is gone, no more calls to it."""
        holder = self._holder()
        if isinstance(error, dist.DistNetworkError) and holder is not None:
            self._lost = weakref.ref(holder)

    def named(self, rank: int) -> int:
        """The process's rank in the world, for messages, of `rank` in the group (they
        differ in groups of their own: a hybrid cfg=2 branch, a `Ring` given a group)."""
        group = self._group()
        try:
            return rank if group is None else dist.get_global_rank(group, rank)
        except (RuntimeError, ValueError):
            return rank

    def begin(self) -> int:
        """The number of the run this rank begins now."""
        self.runs += 1
        return self.runs

    def stop(self, run: int, rank: int, error: BaseException) -> None:
        """Rank `rank` stops run `run`, `error` raised on it: said in the store, and noted
        on `error` (`told`). A store out of reach (its host, rank 0, gone) leaves the peers
        to their transport's errors."""
        store = self._store()
        if store is not None:
            try:
                store.set(f"{self._prefix}{run}", f"rank {self.named(rank)}: {_said(error)}")
            except RuntimeError as failure:  # dist.DistError among them
                self._failed(failure)
        told(error)

    def say_call(self, run: int, rank: int, what: str) -> None:
        """Rank `rank` runs run `run` as `what` (a call's step, branch and timestep): said
        in the store, for `calls_said`; its key of two runs before, read by every rank by
        now, goes."""
        store = self._store()
        if store is None:
            return
        try:
            store.set(self._call_key(run, rank), what)
            if run > 2:
                store.delete_key(self._call_key(run - 2, rank))
        except RuntimeError as failure:
            self._failed(failure)

    def calls_said(self, run: int, world: int, timeout: float) -> list[str] | None:
        """What each rank said run `run` is (`say_call`), in rank order, waiting at most
        `timeout` for a rank yet to say it; None where the store cannot tell."""
        store = self._store()
        if store is None:
            return None
        keys = [self._call_key(run, rank) for rank in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
            values = store.multi_get(keys) if hasattr(store, "multi_get") else \
                [store.get(key) for key in keys]  # one round trip where the store can
            return [value.decode(errors="replace") for value in values]
        except RuntimeError as failure:
            self._failed(failure)
            return None

    def first_failure(self, said: str) -> str | None:
        """The failed wait a rank of the group said first during this rank's current run
        (`said`, this rank's, becomes it where none did): a peer's connection lost because
        a third rank died is that rank's fault, not the peer's. None where this rank's is
        the first (or the store cannot tell)."""
        store = self._store()
        if store is None:
            return None
        try:
            first = store.compare_set(f"{self._prefix}failed/{self.runs}", "", said)
        except RuntimeError as failure:
            self._failed(failure)
            return None
        first = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
        return None if first == said else first

    def _call_key(self, run: int, rank: int) -> str:
        return f"{self._prefix}call/{run}/{rank}"

    def seen(self, run: int) -> str | None:
        """Who stopped run `run` and why (None: nobody has)."""
        key, store = f"{self._prefix}{run}", self._store()
        if store is None:
            return None
        try:
            if not store.check([key]):
                return None
            return store.get(key).decode(errors="replace")
        except RuntimeError as failure:
            self._failed(failure)
            return None


class DeferredInterrupts:
    """Within the block, a Ctrl-C (SIGINT, under Python's own handler, in the main thread)
    is held until `raise_pending` is called, between two actions: raised inside a message's
    wait, it would leave a receive half taken, which no hollow run can finish."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None

    def __enter__(self) -> DeferredInterrupts:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        self.pending = True

    def raise_pending(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            if self.pending:  # one that came after the last action: delivered as it came
                self.pending = False
                signal.raise_signal(signal.SIGINT)


def told(error: BaseException) -> None:
    """Marks `error` as said to the peers (they stop this call themselves: nothing more
    need reach them), and says so under it."""
    with contextlib.suppress(AttributeError, TypeError):
        error._tokpipe_told = True  # type: ignore[union-attr]
        error.add_note("tokpipe: the other ranks were told and stop this call too; the "
                       "process group carries the next call, which starts a new generation")


def was_told(error: BaseException) -> bool:
    return getattr(error, "_tokpipe_told", False)


def peer_stopped(who: str, rank: int, mid_run: bool) -> PeerStopped:
    """The error of a rank whose run a peer stopped (`who`: the peer and its error), seen
    mid-run (the rest run hollow) or once the run was over."""
    seen = ("mid-run, ran the rest of this call's schedule without computing (so no rank "
            "waits for a message)" if mid_run else "once this call's messages were over")
    return PeerStopped(
        f"{who}; rank {rank} saw it {seen} and stops this call too. The process group "
        "carries the next call as ever, which starts a new generation (the K/V caches this "
        "call wrote are dropped)")


def _said(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
