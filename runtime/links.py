"""The point-to-point links a `DistributedTransport` sends over: torch.distributed's isend
and irecv, each direction of a pair of ranks in a process group of its own.

NCCL runs a pair's point-to-point messages, both ways, on one stream per communicator, in
the order each end posts them, and a large send waits until its receive is posted. A
receive posted ahead from a peer then holds back every later send to that peer. In a ring
of two ranks (the last stage sends each chunk back to the first) rank 0 posts its receives
of the carried chunks before it sends the boundary values that rank 1 needs to produce
them, so with one communicator both ranks would wait for ever; at tiny sizes NCCL buffers
a send and hides this. So a message to a higher rank travels in the group itself and a
message to a lower rank in a second group of the same ranks (`back_group`): each
communicator carries a pair's messages one way only, which both ends post in schedule
order. gloo matches messages by tag and needs none of this; it gets the same two groups.

A pair's communicator is created by its first message, and creating it blocks until both
ends arrive. Ranks whose pairs first met in different orders could wait in a circle (rank 0
creating its back communicator with rank 1 while rank 1 creates its forward one with rank
0), so the first transport over a group sends every pair's first messages, both ways, in
one order on every rank (`DistributedTransport.connect`), before any other.

Groups are held weakly, and the world is looked up at each message: after
`destroy_process_group` nothing here keeps a group, or the store it was made over, alive. A
store held past it keeps serving the old groups' keys to the groups started after it on the
same port (torch shares a port's store within a process), whose ranks then connect to the
old groups' addresses and wait in vain. Links over the world move to a world started anew
(making its back group and connecting its pairs at their next message); links over a
destroyed group that was given raise.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.backends import group_backend
from tokpipe_compiler.runtime.run_stops import RunStops, group_store
from tokpipe_compiler.runtime.transport_errors import GroupClosed

FORWARD, BACK = 0, 1  # a message to a higher rank, to a lower one


def direction(src: int, dst: int) -> int:
    """The way a message from group rank `src` to `dst` travels."""
    return FORWARD if dst > src else BACK


class Work(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self, timeout: Any = ...) -> Any: ...


class Links(Protocol):
    """What a transport sends over: ranks of one group, and its point-to-point messages."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    connected: bool  # whether every pair has met (DistributedTransport.connect)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None: ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None: ...


class TorchLinks:
    """torch.distributed between the ranks of `group` (default: the world, as it is at each
    message). Tensors live on the rank's device: the current CUDA device under NCCL, the CPU
    otherwise."""

    def __init__(self, group: Any = None, timeout: float | None = None):
        self._given = None if group is None else weakref.ref(group)
        self._timeout = timeout
        base = self._base()
        self.rank = dist.get_rank(base)
        self.world_size = dist.get_world_size(base)
        self.backend = group_backend(base)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self._pair = _groups(base, timeout)

    def _base(self) -> Any:
        """The group the messages travel in; raises where it is gone."""
        if self._given is not None:
            base = self._given()
            if base is None:
                raise _given_gone()
            return base
        if not dist.is_initialized():
            raise GroupClosed(
                "the process group this pipeline ran in has been destroyed and none started "
                "since: start one on every rank (init_process_group) before calling it again")
        return dist.group.WORLD

    def _now(self) -> _Groups:
        """The groups messages take now: after the world was started anew, its own (made
        at this first message, on every rank alike), on a world of the same ranks."""
        base = self._base()
        if self._pair.base() is base and self._pair.back() is not None:
            return self._pair
        if self._given is not None:  # held elsewhere, but destroyed with its back group
            raise _given_gone()
        if (dist.get_rank(base), dist.get_world_size(base)) != (self.rank, self.world_size):
            raise GroupClosed(
                f"the process group was started anew with {dist.get_world_size(base)} ranks, "
                f"this one rank {dist.get_rank(base)}; the pipeline was made on "
                f"{self.world_size}, this one rank {self.rank}: make it anew")
        self._pair = _groups(base, self._timeout)
        return self._pair

    @property
    def connected(self) -> bool:
        return self._now().connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self._now().connected = value

    @property
    def stops(self) -> RunStops | None:
        """The stop keys of the group's runs (`run_stops`)."""
        return self._now().stops

    @property
    def broken(self) -> str:
        """Why the group carries no message any more ("" while it does)."""
        return self._now().broken

    @broken.setter
    def broken(self, value: str) -> None:
        self._now().broken = value

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None:
        group = self._now().way(direction(self.rank, peer))
        return dist.isend(tensor, group=group, tag=tag, group_dst=peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None:
        group = self._now().way(direction(peer, self.rank))
        return dist.irecv(tensor, group=group, tag=tag, group_src=peer)


def _given_gone() -> GroupClosed:
    return GroupClosed(
        "the process group this pipeline was made for has been destroyed: make the pipeline "
        "(or Ring) anew over the group started after it")


@dataclass
class _Groups:
    base: weakref.ref  # the group itself
    back: weakref.ref  # its back group
    connected: bool = False
    broken: str = ""  # gloo closes a pair for good after a failed wait: the first one's
    stops: RunStops | None = None

    def way(self, way: int) -> Any:
        """The group of a direction (`_now` saw the group alive)."""
        return self.base() if way == FORWARD else self.back()


def collective_failed(group: Any, said: str) -> str | None:
    """A collective over `group` (None: the world) failed, `said` so: recorded as the
    group's failure, the first of its run where no rank said one before
    (`RunStops.first_failure`: returned where another rank did), and, under gloo, which
    closes its pairs for good, as what later messages over it raise at once
    (`GroupClosed`)."""
    base = dist.group.WORLD if group is None else group
    made = None if base is None else _made.get(base)
    if made is None:
        return None
    if group_backend(base) == "gloo":
        made.broken = made.broken or said
    return None if made.stops is None else made.stops.first_failure(said)


# A group's two groups, by the group: an entry goes with its group (destroy_process_group).
_made: weakref.WeakKeyDictionary[Any, _Groups] = weakref.WeakKeyDictionary()


def _groups(base: Any, timeout: float | None = None) -> _Groups:
    """`base` and the group of the same ranks that carries its messages to lower ranks,
    made once per group. Making it is collective over those ranks: each makes its first
    transport over `base` at the same point of the program (planning), and waits at most
    `timeout` seconds (None: the process group's own timeout) for the others to."""
    known = _made.get(base)
    if known is not None and known.back() is not None:
        return known
    ranks = dist.get_process_group_ranks(base)
    wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    _say_arrived(base)
    try:  # named after its ranks: only they take part in making it
        back = dist.new_group(ranks, backend=group_backend(base),
                              use_local_synchronization=True, **wait)
    except ValueError as err:  # a group of these ranks was made so already
        raise TokpipeError(f"cannot make the second process group of ranks {ranks} that "
                           f"carries messages to lower ranks ({err}); run one tokpipe "
                           "pipeline per set of ranks") from err
    except dist.DistError as err:  # the store's wait timed out: a rank that never came
        waited = "the process group's timeout" if timeout is None else f"{timeout:g} s"
        raise TokpipeError(
            f"rank {dist.get_rank()} waited {waited} for ranks {ranks} to start the pipeline "
            f"(their first call of it) and {_who_did_not_come(base, ranks)}: every rank must "
            "call the pipelined model or pipeline, with the same arguments "
            f"({str(err).splitlines()[0][:200]})") from err
    if dist.get_rank(back) != dist.get_rank(base):  # both number their ranks in one order
        raise RuntimeError("the back group numbers the ranks otherwise than its group")
    _take_back_arrival(base)  # all came: a group made again here starts afresh
    made = _Groups(weakref.ref(base), weakref.ref(back), stops=RunStops(base))
    _made[base] = made
    return made


_ARRIVED = "tokpipe/arrived/"  # + the rank in the group: it has begun making the back group


def _say_arrived(base: Any) -> None:
    """Say in `base`'s store that this rank has come to make its back group, so that ranks
    left waiting can name those that did not (`_who_did_not_come`)."""
    store = group_store(base)
    if store is not None:  # a store whose host is gone: the wait fails and says so
        with contextlib.suppress(RuntimeError):
            store.set(_arrival_key(base), "1")


def _take_back_arrival(base: Any) -> None:
    """Once all came: so that a group of the same name made later over the store (the
    world started anew on a store that outlived it) names a rank that does not come then."""
    store = group_store(base)
    if store is not None:
        with contextlib.suppress(RuntimeError):
            store.delete_key(_arrival_key(base))


def _arrival_key(base: Any) -> str:
    return f"{_ARRIVED}{dist.get_rank(base)}"


def _who_did_not_come(base: Any, ranks: list[int]) -> str:
    """The ranks of `ranks` (world numbering, in `base`'s order) that had not said they
    came when this rank's wait ended, where the store can tell at all."""
    store = group_store(base)
    try:
        absent = [rank for place, rank in enumerate(ranks)
                  if store is not None and not store.check([f"{_ARRIVED}{place}"])]
    except RuntimeError:
        absent = []
    if store is None or not absent:
        return "not all came"
    return f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never came"
