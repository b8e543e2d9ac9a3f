"""Where a ring segment ends on several ranks whose step callbacks end it apart.

Each rank replays its step callbacks on the segment's latents once its ring ran
(`step_callbacks`). A cancel that reached one rank only (a server's front rank) interrupts
the generation there alone, and a callback may raise on one rank. Left so, the ranks
return different images, and where another transformer takes over (Wan 2.2's second
expert) the ranks that go on wait for the others' next ring. So after each segment the
ranks gather where theirs ended: a callback's error on any rank ends the call on every
rank (its error there, `PeerStopped` on the others); an interrupt on any rank ends the
generation on every rank at the earliest step interrupted, with that step's latents, sent
by the rank that has them. Callbacks on the other ranks may have seen later steps by then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import PeerStopped
from tokpipe_compiler.pipelines.step_callbacks import StepCallbacks
from tokpipe_compiler.runtime.transport_errors import wait_collective

_NOT_ENDED = -1


def agree_on_the_end(callbacks: StepCallbacks | None, like: torch.Tensor,
                     timeout: float) -> torch.Tensor | None:
    """The latents every rank ends the segment that just ran at: those of the earliest
    step any rank's callbacks (None on a rank that passed none) interrupted it at; None
    where none did. `like`: the segment's latents on this rank (shape, dtype and device of
    what an interrupting rank sends). Raises on every rank where a callback raised on one."""
    step = _NOT_ENDED if callbacks is None or callbacks.interrupted_step is None \
        else callbacks.interrupted_step
    errored = callbacks is not None and callbacks.error is not None
    every = _gather(torch.tensor([step, int(errored)], device=like.device), timeout).tolist()
    raised = [rank for rank, (_, error) in enumerate(every) if error]
    if raised:
        if errored:
            callbacks.raise_error()
        raise PeerStopped(f"the step callback of rank {raised[0]} raised at the end of the "
                          "ring (its error is raised there): the pipeline call ended on "
                          "every rank")
    ended = [s for s, _ in every if s != _NOT_ENDED]
    if not ended:
        return None
    first = min(ended)
    source = next(rank for rank, (s, _) in enumerate(every) if s == first)
    mine = callbacks.interrupted if dist.get_rank() == source else None
    latents = like.contiguous() if mine is None else mine.to(like.dtype).contiguous()
    work = dist.broadcast(latents, src=source, async_op=True)
    wait_collective(work, timeout, f"the latents of step {first}, where rank {source}'s step "
                         "callback interrupted the generation")
    return latents


def _gather(mine: torch.Tensor, timeout: float) -> torch.Tensor:
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    work = dist.all_gather(every, mine, async_op=True)
    wait_collective(work, timeout, "where each rank's step callbacks ended the ring's steps")
    return torch.stack(every).cpu()

