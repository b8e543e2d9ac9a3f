"""Moves activations between pipeline ranks: torch.distributed point-to-point (the in-process
form with the same interface is `local_transport`).

Both share one interface. Receives are posted ahead of need (`post_recv`), sends
return at once (`send`), and every wait is bounded by `timeout`: a missing message becomes a
TokpipeError that names both ranks and the message, never a hang.

Shapes and dtypes are agreed once from the plan (`TensorSpec`), so a message carries raw
bytes only. Messages between a pair of ranks match by tag where the backend has tags (gloo)
and by posting order where it has none (NCCL): both ends must post a pair's messages in the
same order, which the schedule guarantees; each direction of a pair has a communicator of its
own (`links.py`), so a receive posted ahead never holds back a send the other way.

Sends are completed as a run goes: starting a send of step s first waits for this rank's
sends of steps <= s - SEND_LAG_STEPS, so a ring holds about two steps of sent tensors however
long it runs. A schedule must therefore post a step's receives before the sender is
SEND_LAG_STEPS steps further on.

gloo: a send completes only once the peer has posted the matching receive, so post receives
before `flush`ing sends, or two ranks that send to each other wait for ever. After a
timed-out wait gloo closes the connection to that peer for good.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.links import Links, TorchLinks, Work
from tokpipe_compiler.runtime.run_stops import RunStops
from tokpipe_compiler.runtime.transport_errors import (
    EARLIER,
    GLOO_CLOSED,
    closed_error,
    first_line,
    headline,
    reason_of,
    recv_error,
    send_error,
)

_MAX_TAG = 2**31 - 1  # torch passes tags to the backend as a C int
# How many steps behind the newest send a started send may stay incomplete (see above).
SEND_LAG_STEPS = 2
# `MessageKey.chunk` of a message that is not one chunk's (a whole output, a fingerprint).
WHOLE = -1
CONNECT_STEP = -2  # the step of the messages that connect a transport's pairs
POLL_PAUSE = 2e-4  # the longest pause between polls of an NCCL work (seconds)

ErrorFn = Callable[[str], TokpipeError]

# The longest wait a timeout may ask for (the options check it too: config.py).
MAX_TIMEOUT = 7 * 24 * 3600.0


@dataclass(frozen=True)
class MessageKey:
    """What a message is. `stage` is the stage the message is addressed to; `what`, if set,
    is how errors name the message (for messages that are not one chunk's value)."""

    step: int
    stage: int
    chunk: int
    name: str
    what: str = ""

    def __str__(self) -> str:
        return self.what or f"step {self.step} chunk {self.chunk} {self.name!r}"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a message, known to both ends from the plan."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class RecvHandle(Protocol):
    def wait(self) -> torch.Tensor:
        """The received tensor; raises TokpipeError after the transport's timeout."""
        ...


class Transport(Protocol):
    rank: int
    world_size: int
    timeout: float

    def post_recv(self, key: MessageKey, src: int, spec: TensorSpec) -> RecvHandle: ...

    def send(self, key: MessageKey, tensor: torch.Tensor, dst: int) -> None: ...

    def flush(self) -> None: ...

    @property
    def stops(self) -> RunStops | None:
        """How a run ends on every rank when one rank's step raises (`run_stops`); None over
        links without a store."""
        return getattr(self.links, "stops", None)

    def let_sends_wait(self, peers: Collection[int]) -> None: ...

    def close(self) -> None: ...


def check_timeout(timeout: float) -> None:
    """A finite, positive number of seconds that timedelta and the backends can hold."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout <= MAX_TIMEOUT:  # also rejects nan
        raise TokpipeError(f"transport timeout must be a finite number of seconds, > 0 and "
                           f"<= {MAX_TIMEOUT:.0f} (a week), got {timeout!r}")


def message_tag(key: MessageKey, piece: int) -> int:
    """A tag derived from the key alone, identical in every process (unlike `hash`).

    Collisions are harmless: equal tags between a pair still match in posting order.
    """
    text = f"{key.step}/{key.stage}/{key.chunk}/{key.name}/{piece}"
    return zlib.crc32(text.encode()) & _MAX_TAG


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy-or-alias of `tensor`: bit-exact for any dtype."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # a one-element broadcast (a pipeline's `t.expand(batch)` at batch 1) is contiguous
        # with stride 0, which a byte view refuses
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def from_bytes(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return data.view(spec.dtype).view(spec.shape)


def pieces(data: torch.Tensor, max_bytes: int) -> tuple[torch.Tensor, ...]:
    """Contiguous slices of a flat byte tensor, each at most `max_bytes`; none if empty."""
    return data.split(max_bytes) if data.numel() else ()


class _Failed(Exception):
    """A backend work did not complete: `reason` is for the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _DistRecv:
    def __init__(self, owner: DistributedTransport, key: MessageKey, src: int, spec: TensorSpec):
        self._owner, self._key, self._src, self._spec = owner, key, src, spec
        self._data = torch.empty(spec.nbytes, dtype=torch.uint8, device=owner.device)
        self._works = [
            owner._post(owner.links.irecv, piece, src, message_tag(key, i), self._error)
            for i, piece in enumerate(pieces(self._data, owner.max_message_bytes))
        ]

    def _error(self, reason: str) -> TokpipeError:
        return recv_error(self._owner.rank, self._src, self._key, reason)

    def wait(self) -> torch.Tensor:
        self._owner._wait_all(self._works, time.monotonic() + self._owner.timeout, self._error)
        self._works = []
        return from_bytes(self._data, self._spec)


@dataclass
class _PendingSend:
    key: MessageKey
    dst: int
    works: list[Work]
    data: torch.Tensor  # keeps the sent memory alive until the backend is done with it


class DistributedTransport:
    """torch.distributed isend/irecv between the ranks of `group` (default: the world), or
    over other `links` (`links.Links`: an emulated backend in tests).

    Tensors live on the rank's device: the current CUDA device under NCCL, CPU otherwise.
    Messages larger than `max_message_bytes` go in pieces (single huge messages hang some
    NCCL setups) and are reassembled into one tensor.
    """

    def __init__(self, timeout: float = 60.0, max_message_bytes: int = 16 * 2**20, group=None,
                 links: Links | None = None):
        if links is None and not dist.is_initialized():
            raise TokpipeError(
                "DistributedTransport needs torch.distributed initialised: run under torchrun "
                "and call process_group.init_process_group_from_env(), or use "
                "runtime.launch.launch()."
            )
        if max_message_bytes < 1:
            raise TokpipeError(f"max_message_bytes must be positive, got {max_message_bytes}")
        check_timeout(timeout)
        self.links = links if links is not None else TorchLinks(group, timeout)
        self.rank, self.world_size = self.links.rank, self.links.world_size
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.backend = self.links.backend
        self.device = self.links.device
        # gloo's point-to-point is_completed() stays false until wait() is called, so gloo
        # must use wait(timeout); NCCL's wait has no usable timeout, so others are polled.
        self._native_timeout = self.backend == "gloo"
        self._sends: list[_PendingSend] = []
        self._waiting: list[_PendingSend] = []  # sends to peers that left (let_sends_wait)
        self._connect_once()

    def _connect_once(self) -> None:
        """`connect` at the links' first message: at the first transport over a group, and
        at the first message over a world started anew (`links.py`)."""
        if not self.links.connected:
            self.links.connected = True  # set first: connect's own messages pass through here
            self.connect()

    def connect(self) -> None:
        """A first message to and from every peer, pairs taken in one order on every rank
        (by the lower rank, then the higher): under NCCL a pair's first message creates its
        communicator and waits for the other end's (`links.py`)."""
        spec = TensorSpec((1,), torch.uint8)
        first = torch.ones(1, dtype=torch.uint8, device=self.device)

        def key(peer: int, dst: int) -> MessageKey:  # this rank's message to or from `peer`
            low, high = sorted((self.rank, peer))
            return MessageKey(CONNECT_STEP, dst, WHOLE, "connect",
                              f"the first message between ranks {low} and {high}")

        handles = []
        for peer in range(self.world_size):
            if peer < self.rank:
                handles.append(self.post_recv(key(peer, self.rank), peer, spec))
                self.send(key(peer, peer), first, peer)
            elif peer > self.rank:
                self.send(key(peer, peer), first, peer)
                handles.append(self.post_recv(key(peer, self.rank), peer, spec))
        for handle in handles:
            handle.wait()
        self.flush()

    def post_recv(self, key: MessageKey, src: int, spec: TensorSpec) -> RecvHandle:
        """Posts the receive now; `wait()` on the handle bounds the wait by `timeout`."""
        self._check_open(key)
        self._connect_once()
        return _DistRecv(self, key, src, spec)

    def _check_open(self, key: MessageKey) -> None:
        """Raises, naming the first failure, where gloo has closed the group's connections:
        not the "check that the peer is alive" of a send that cannot be posted."""
        if getattr(self.links, "broken", ""):
            raise closed_error(self.rank, key, self.links.broken)

    def send(self, key: MessageKey, tensor: torch.Tensor, dst: int) -> None:
        """Starts sending; `tensor` must not be modified until `flush` returns."""

        def error(reason: str) -> TokpipeError:
            return send_error(self.rank, dst, key, reason)

        self._check_open(key)
        self._connect_once()
        if tensor.device != self.device:
            raise error(
                f"the tensor is on {tensor.device}; this transport sends from {self.device}"
            )
        self._complete_before(key.step - SEND_LAG_STEPS)
        data = as_bytes(tensor)
        works = [
            self._post(self.links.isend, piece, dst, message_tag(key, i), error)
            for i, piece in enumerate(pieces(data, self.max_message_bytes))
        ]
        self._sends.append(_PendingSend(key, dst, works, data))
        self._reap()

    def flush(self) -> None:
        """Waits for every started send, all within one `timeout`."""
        deadline = time.monotonic() + self.timeout
        while self._sends:
            self._finish(self._sends[0], deadline)
            self._sends.pop(0)

    @property
    def stops(self) -> RunStops | None:
        """How a run ends on every rank when one rank's step raises (`run_stops`); None over
        links without a store."""
        return getattr(self.links, "stops", None)

    def let_sends_wait(self, peers: Collection[int]) -> None:
        """The started sends to `peers` stop holding `flush` up: a peer that left a pipeline
        call takes them at its next exchange, which may come later than `timeout`. They
        stay posted (their tensors held) until then."""
        self._waiting += [s for s in self._sends if s.dst in peers]
        self._sends = [s for s in self._sends if s.dst not in peers]

    def close(self) -> None:
        self.flush()

    def _post(
        self, op: Callable, piece: torch.Tensor, peer: int, tag: int, error: ErrorFn
    ) -> Work:
        # NCCL ignores the tag; there, matching relies on both ends' posting order.
        try:
            work = op(piece, peer, tag)
        except (RuntimeError, ValueError) as e:  # e.g. gloo closes a pair after a timeout
            raise error(self._failed(f"could not post ({first_line(e)})", error)) from e
        if work is None:
            raise error(f"rank {self.rank} is not in the transport's process group")
        return work

    def _finish(self, pending: _PendingSend, deadline: float) -> None:
        def error(reason: str) -> TokpipeError:
            return send_error(self.rank, pending.dst, pending.key, reason)

        self._wait_all(pending.works, deadline, error)

    @property
    def pending_sends(self) -> int:
        """Sends started and not yet known to be complete."""
        return len(self._sends)

    def _complete_before(self, step: int) -> None:
        """Waits for the sends of steps <= `step`: under gloo a send looks unfinished until
        waited for, so without this a ring would hold every sent tensor until `flush`."""
        deadline = time.monotonic() + self.timeout
        while self._sends and self._sends[0].key.step <= step:
            self._finish(self._sends.pop(0), deadline)

    def _reap(self) -> None:
        """Drop finished sends (surfacing their errors) so long runs hold no stale tensors.

        Under gloo nothing looks finished before it is waited for: there `flush` does this.
        """
        while self._sends and all(w.is_completed() for w in self._sends[0].works):
            self._finish(self._sends.pop(0), time.monotonic() + self.timeout)

    def _wait_all(self, works: list[Work], deadline: float, error: ErrorFn) -> None:
        wait = _wait_native if self._native_timeout else _wait_polling
        try:
            for work in works:
                wait(work, deadline, self.timeout)
        except _Failed as failed:
            raise error(self._failed(failed.reason, error)) from None

    def _failed(self, reason: str, error: ErrorFn) -> str:
        """`reason`, said of a failed post or wait; under gloo, which closes the pair for
        good, the group is marked closed (later messages raise at once) and it says so.
        Its unfinished sends are dropped: their works would keep the group's store alive
        after destroy_process_group, for a group started anew on its port to take over."""
        stops = self.stops
        earlier = None if stops is None else stops.first_failure(headline(error(reason)))
        if earlier is not None:
            reason = f"{reason}. {EARLIER}{earlier}"
        if not (self._native_timeout and hasattr(self.links, "broken")):
            return reason
        self.links.broken = self.links.broken or headline(error(reason))
        self._sends.clear()
        self._waiting.clear()
        return f"{reason}; {GLOO_CLOSED}"


def _wait_native(work: Work, deadline: float, timeout: float) -> None:
    # gloo raises on timeout (and then closes the pair for good); returning False is
    # treated the same in case a version reports it that way.
    remaining = max(deadline - time.monotonic(), 1e-3)
    try:
        completed = work.wait(timeout=timedelta(seconds=remaining))
    except RuntimeError as e:
        raise _Failed(reason_of(e, timeout)) from None
    if completed is False:
        raise _Failed(f"timed out after {timeout:g} s")


def _wait_polling(work: Work, deadline: float, timeout: float) -> None:
    # NCCL's wait() only orders streams and has no usable timeout: poll the work's event.
    # is_completed() is also true for a failed work, so wait() still has to run. The pause
    # stays short: a message that lands mid-pause waits for it, at every hop of every chunk
    # (chunks of a few ms on a GPU), and a rank's host has nothing else to do meanwhile.
    pause = 2e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise _Failed(f"timed out after {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, POLL_PAUSE)
    try:
        work.wait()  # raises the backend's error, if any; orders the current stream
    except RuntimeError as e:
        raise _Failed(reason_of(e, timeout)) from None

