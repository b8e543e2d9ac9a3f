"""The guidance branches' exchange inside a ring: `tokpipe::cfg_gather`.

With classifier-free guidance split over two groups of pipeline stages (cfg=2 with
stages > 1), each group runs the transformer on its own guidance branch, and guidance needs
both branches' predictions token by token. The step function calls `cfg_gather` on its
branch's prediction; the compiler keeps it token-wise, so it lands in the last stage and
runs once per chunk. There the two groups' last stages, which run the same schedule, swap
their chunk of the prediction: both get the chunk of both branches, in branch order, and
both apply the same guidance and scheduler update (the same bits on both groups).

The peers are set by `exchanging(group, timeout)` around the ring's run; a call outside it
is an error.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.op_library import define_op


@dataclass(frozen=True)
class _Peers:
    group: Any  # a process group of two ranks: this stage in either guidance branch
    timeout: float


_active: list[_Peers] = []


@contextlib.contextmanager
def exchanging(group: Any, timeout: float) -> Iterator[None]:
    """`cfg_gather` calls inside swap predictions over `group` (two ranks, branch order)."""
    if dist.get_world_size(group) != 2:
        raise TokpipeError("the guidance branches' exchange needs a group of two ranks (one "
                           f"per branch), got {dist.get_world_size(group)}")
    _active.append(_Peers(group, timeout))
    try:
        yield
    finally:
        _active.pop()


def exchanging_now() -> bool:
    """Whether a guidance exchange is set up (a hybrid cfg=2 ring's run). Its runs do not
    stop on every rank together (`run_stops`): the other branch's last stage waits inside
    the exchange, where no stop reaches it, so an error there leaves it its `timeout`."""
    return bool(_active)


def _cfg_gather(x: torch.Tensor) -> torch.Tensor:
    """Both guidance branches' `x` along the batch (dim 0), branch 0 first."""
    if not _active:
        raise TokpipeError("cfg_gather ran outside a guidance exchange: the step function of "
                           "a hybrid cfg=2 ring runs only inside tp.pipelines.parallelize")
    peers = _active[-1]
    return gather_branches(x, peers.group, peers.timeout, f"a chunk of shape {tuple(x.shape)}")


def gather_branches(x: torch.Tensor, group: Any, timeout: float, what: str) -> torch.Tensor:
    """Both ranks' `x` of a two-rank `group` (default: the world) along dim 0, in rank
    order, waiting at most `timeout` seconds; `what` names the value in the error."""
    mine = x.contiguous()
    both = [torch.empty_like(mine) for _ in range(2)]
    work = dist.all_gather(both, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as err:
        raise TokpipeError(f"cfg=2: rank {dist.get_rank()} waiting for the other guidance "
                           f"branch's prediction ({what}): {err}") from err
    return torch.cat(both)


def _cfg_gather_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((2 * x.shape[0], *x.shape[1:]))


cfg_gather = define_op("cfg_gather", _cfg_gather, _cfg_gather_fake)
