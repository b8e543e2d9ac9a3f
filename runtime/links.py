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
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError

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
    """torch.distributed between the ranks of `group` (default: the world). Tensors live on
    the rank's device: the current CUDA device under NCCL, the CPU otherwise."""

    def __init__(self, group: Any = None, timeout: float | None = None):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self._pair = _groups(group, timeout)

    @property
    def connected(self) -> bool:
        return self._pair.connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self._pair.connected = value

    @property
    def broken(self) -> str:
        """Why the group carries no message any more ("" while it does)."""
        return self._pair.broken

    @broken.setter
    def broken(self, value: str) -> None:
        self._pair.broken = value

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None:
        group = self._pair.groups[direction(self.rank, peer)]
        return dist.isend(tensor, group=group, tag=tag, group_dst=peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work | None:
        group = self._pair.groups[direction(peer, self.rank)]
        return dist.irecv(tensor, group=group, tag=tag, group_src=peer)


@dataclass
class _Groups:
    groups: tuple[Any, Any]  # by direction: the group itself, its back group
    connected: bool = False
    broken: str = ""  # gloo closes a pair for good after a failed wait: the first one's


_made: dict[int, tuple[Any, _Groups]] = {}  # id(group) -> (group, its two groups)


def _groups(group: Any, timeout: float | None = None) -> _Groups:
    """`group` and the group of the same ranks that carries its messages to lower ranks,
    made once per group. Making it is collective over those ranks: each makes its first
    transport over `group` at the same point of the program (planning), and waits at most
    `timeout` seconds (None: the process group's own timeout) for the others to."""
    base = group if group is not None else dist.group.WORLD
    known = _made.get(id(base))
    if known is not None and known[0] is base:
        return known[1]
    ranks = dist.get_process_group_ranks(base)
    wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    try:  # named after its ranks: only they take part in making it
        back = dist.new_group(ranks, backend=dist.get_backend(base),
                              use_local_synchronization=True, **wait)
    except ValueError as err:  # a group of these ranks was made so already
        raise TokpipeError(f"cannot make the second process group of ranks {ranks} that "
                           f"carries messages to lower ranks ({err}); run one tokpipe "
                           "pipeline per set of ranks") from err
    except dist.DistError as err:  # the store's wait timed out: a rank that never came
        waited = "the process group's timeout" if timeout is None else f"{timeout:g} s"
        raise TokpipeError(
            f"rank {dist.get_rank()} waited {waited} for ranks {ranks} to start the pipeline "
            "(their first call of it) and not all came: every rank must call the pipelined "
            f"model or pipeline, with the same arguments ({str(err).splitlines()[0][:200]})"
        ) from err
    if dist.get_rank(back) != dist.get_rank(base):  # both number their ranks in one order
        raise RuntimeError("the back group numbers the ranks otherwise than its group")
    made = _Groups((group, back))
    _made[id(base)] = (base, made)
    return made
