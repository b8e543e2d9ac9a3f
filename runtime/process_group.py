"""Starting torch.distributed from the environment a launcher sets (torchrun, `launch`, a
process manager): MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE."""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import TokpipeError

# How rank 0, which serves the rendezvous store, tells how many ranks reached it.
_JOINED = re.compile(r"(\d+)/\d+ clients joined")


def init_process_group_from_env(device: torch.device | str | None = None,
                                timeout: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's env:// variables; returns (rank, world).

    NCCL for a CUDA device (set from LOCAL_RANK), gloo otherwise; `None` means CUDA when
    available. `timeout`: seconds to wait for every rank to join, and the group's own
    timeout (None: torch's default, 30 minutes for gloo); a rank that does not join in it
    is a TokpipeError that names it. Does nothing but report if already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    required = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    missing = [v for v in required if v not in os.environ]
    if missing:
        raise TokpipeError(
            f"cannot initialise torch.distributed: {', '.join(missing)} not set. Launch with "
            "torchrun, or tokpipe_compiler.runtime.launch.launch() on one machine."
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "gloo"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    try:
        dist.init_process_group(backend, init_method="env://", **wait)
    except dist.DistError as err:  # the rendezvous timed out (or found no rank 0)
        raise TokpipeError(_not_joined(err, timeout)) from err
    return dist.get_rank(), dist.get_world_size()


def _not_joined(err: dist.DistError, timeout: float | None) -> str:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    waited = "torch's default timeout" if timeout is None else f"{timeout:g} s"
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return (
        f"rank {rank} waited {waited} for the {world} ranks (WORLD_SIZE) to join the process "
        f"group at {where}, and {_absent(err, rank, world)} did not "
        f"({str(err).strip().splitlines()[0][:200].rstrip('.')}). Start every rank with the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE and its own RANK, and have each call the "
        "pipeline (tokpipe starts the group at a rank's first call where the script has not); "
        "raise the timeout option if a rank starts later than that."
    )


def _absent(err: dist.DistError, rank: int, world: int) -> str:
    """The ranks that did not join, as far as `err` tells."""
    others = [r for r in range(world) if r != rank]
    if rank != 0 and isinstance(err, dist.DistNetworkError):  # no store: rank 0 serves it
        return "rank 0"
    joined = _JOINED.search(str(err))
    named = f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    if joined is None:
        return f"one or more of {named}"
    absent = world - int(joined.group(1))
    return named if absent == len(others) else f"{absent} of {named}"
