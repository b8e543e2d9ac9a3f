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

A run that one rank stops (`run_stops`) stops on both branches' ranks: their groups share
its stop keys (`run_stops.share_stops`). A stopped last stage goes on taking part in
the exchanges its schedule has left, with zeros (`hollow_exchanges`), so that the other
branch's last stage, waiting in one until it sees the stop, is not left waiting: every
exchange is matched, and the group carries the next run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.core.stage_graph import StageGraph
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.op_library import define_op
from tokpipe_compiler.runtime.transport_errors import wait_collective


@dataclass
class _Peers:
    group: Any  # a process group of two ranks: this stage in either guidance branch
    timeout: float
    made: int = 0  # exchanges made by the compute action under way (see `hollow_exchanges`)


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
    """Whether a guidance exchange is set up (a hybrid cfg=2 ring's run)."""
    return bool(_active)


def _cfg_gather(x: torch.Tensor) -> torch.Tensor:
    """Both guidance branches' `x` along the batch (dim 0), branch 0 first."""
    if not _active:
        raise TokpipeError("cfg_gather ran outside a guidance exchange: the step function of "
                           "a hybrid cfg=2 ring runs only inside tp.pipelines.parallelize")
    return _exchange(_active[-1], x)


def _exchange(peers: _Peers, x: torch.Tensor) -> torch.Tensor:
    """Both branches' `x`, counted in the action under way."""
    both = gather_branches(x, peers.group, peers.timeout, f"a chunk of shape {tuple(x.shape)}")
    peers.made += 1
    return both


def start_action() -> None:
    """A compute action begins (or ended whole): none of its exchanges made yet."""
    if _active:
        _active[-1].made = 0


def hollow_exchanges(shapes: list[tuple[tuple[int, ...], torch.dtype]],
                     device: torch.device) -> None:
    """A stopped rank's part in the exchanges of one compute action, `shapes` those its
    graph makes, in order: zeros, past those the action made before it raised, so that the
    other branch's last stage, waiting in one until it sees the stop, is not left waiting."""
    peers = _active[-1]
    for shape, dtype in shapes[peers.made:]:
        _exchange(peers, torch.zeros(shape, dtype=dtype, device=device))
    peers.made = 0


def exchange_shapes(stage: StageGraph, chunk: Chunk) -> list[tuple[tuple[int, ...],
                                                                    torch.dtype]]:
    """Shape and dtype of each prediction `stage`'s graph exchanges on `chunk`, in order."""
    shapes = []
    for node in stage.gm.graph.nodes:
        if node.target is cfg_gather:
            source = node.args[0]
            value, info = example_value(source), source.meta[META_KEY]  # annotate's, always
            shape = list(value.shape)
            if info.axis is not None:  # else a whole value, the same on every chunk
                shape[info.axis] = info.extent(chunk.units, chunk.segments)
            shapes.append((tuple(shape), value.dtype))
    return shapes


def other_branch_stopped(stopped: bool, device: torch.device) -> bool:
    """Whether the other branch's output rank stopped this run, this rank saying whether it
    did (one flag each way, at the run's end, before the outputs are shared): a stop after
    the last exchange (a held Ctrl-C, an error in the last step) would otherwise reach the
    other branch's store look in no set order. False outside a guidance exchange."""
    if not _active:
        return False
    peers = _active[-1]
    flags = gather_branches(torch.tensor([float(stopped)], device=device), peers.group,
                            peers.timeout, "whether its run stopped")
    return bool(flags[1 - dist.get_rank(peers.group)])


def gather_branches(x: torch.Tensor, group: Any, timeout: float, what: str) -> torch.Tensor:
    """Both ranks' `x` of a two-rank `group` (default: the world) along dim 0, in rank
    order, waiting at most `timeout` seconds; `what` names the value in the error."""
    mine = x.contiguous()
    both = [torch.empty_like(mine) for _ in range(2)]
    work = dist.all_gather(both, mine, group=group, async_op=True)
    # a message's failure: no hollow run can finish it
    wait_collective(work, timeout, f"the other guidance branch's prediction ({what}), cfg=2",
                    group)
    return torch.cat(both)


def _cfg_gather_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((2 * x.shape[0], *x.shape[1:]))


cfg_gather = define_op("cfg_gather", _cfg_gather, _cfg_gather_fake)
