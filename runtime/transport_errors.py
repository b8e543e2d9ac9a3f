"""The errors a transport raises: a receive or send that failed or timed out, and a
process group gloo has closed for good (every later message raises at once, naming the
first failure)."""

from __future__ import annotations

import datetime
import re
from typing import TYPE_CHECKING

import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.backends import group_backend

if TYPE_CHECKING:
    from tokpipe_compiler.runtime.transport import MessageKey


class TransportError(TokpipeError):
    """A message that could not be moved: a wait that failed or timed out, or a group that
    carries none any more. A run meeting one cannot end on every rank together
    (`run_stops`): its peers meet their own."""


# Said before the first failed wait of a run that another rank saw first.
EARLIER = "Another rank's wait had failed before this one, the likely cause: "


def wait_collective(work: dist.Work, timeout: float, what: str,
                    group: dist.ProcessGroup | None = None) -> None:
    """Wait at most `timeout` seconds for a collective's `work` over `group` (default: the
    world); a TransportError naming `what` (the value this rank waits for) where it fails
    or times out. A collective names no peer: the error says which rank failed first,
    where one said so (`RunStops.first_failure`), and the group carries no message after
    it under gloo (`links.collective_failed`)."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as err:
        from tokpipe_compiler.runtime.links import collective_failed  # links imports this module

        said = f"rank {dist.get_rank()} waiting for {what}: {reason_of(err, timeout)}"
        earlier = collective_failed(group, said)
        cause = f". {EARLIER}{earlier}" if earlier else ""
        gloo = dist.is_initialized() and group_backend(group) == "gloo"
        raise TransportError(f"{said}{cause}. One rank of the group has likely failed or "
                             "died (its own error or exit says why); "
                             f"{GLOO_CLOSED if gloo else 'restart the ranks'}") from err


def recv_error(rank: int, src: int, key: MessageKey, reason: str) -> TransportError:
    return TransportError(
        f"rank {rank} (stage {key.stage}) waiting for {key} from rank {src}: {reason}. "
        f"Check that rank {src} is alive and not stuck (its own error, if any, is the cause), "
        "that every rank runs the same plan and schedule, and raise the transport timeout "
        "if a stage is just slow (a first call may spend minutes compiling)."
    )


def send_error(rank: int, dst: int, key: MessageKey, reason: str) -> TransportError:
    return TransportError(
        f"rank {rank} sending {key} to rank {dst} (stage {key.stage}): {reason}. "
        f"Check that rank {dst} is alive and posts this receive (a send completes only "
        "once it is received), and that every rank runs the same plan and schedule."
    )


# What a failed wait under gloo means for every later message.
GLOO_CLOSED = ("gloo closes a connection for good after a failed wait (a timeout, a lost "
               "peer) on either rank: restart the ranks before running again")


class GroupClosed(TransportError):
    """The process group carries no message any more (gloo closed it after a failure)."""


def closed_error(rank: int, key: MessageKey, since: str) -> GroupClosed:
    return GroupClosed(
        f"rank {rank} cannot exchange {key}: this process group has carried no message since "
        f"an earlier failure ({since}); {GLOO_CLOSED} (or destroy the process group and "
        "start another)."
    )


def headline(err: TokpipeError) -> str:
    """A recv or send error without its advice: what failed, and how."""
    return str(err).split(". Check that", 1)[0]


def reason_of(e: BaseException, timeout: float) -> str:
    """What a backend error says of a failed wait, shortly: a timeout, a lost peer, or
    the backend's first line."""
    text = first_line(e)
    if "timed out" in text.lower():
        return f"timed out after {timeout:g} s ({text})"
    if any(sign in text for sign in _LOST):
        return f"failed ({text}): the connection was lost, the peer has likely died"
    return f"failed ({text})"


# How gloo reports a peer process that is gone (exit, crash, kill).
_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe")


def first_line(e: BaseException) -> str:
    """The backend's message without the C++ source location gloo puts first."""
    lines = str(e).strip().splitlines()
    return _SOURCE_LOCATION.sub("", lines[0]) if lines else type(e).__name__


_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+:\d+\]\s*")
