"""How the ranks of `tokpipe generate` work together besides the pipeline: a group for the
command's own waits (rank 0's serial run), rank 0's report of every rank, and output that
one rank gives for all."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any


@contextmanager
def command_group(world: int, args: argparse.Namespace) -> Iterator[Any]:
    """A gloo group of every rank for the command's own waits (None in one process), whose
    limit is --timeout: in it the other ranks wait out rank 0's serial run, which may outlast
    the default group's timeout (gloo's 30 minutes, NCCL's 10). Under torchrun the default
    group starts here, before the serial run."""
    if world == 1:
        yield None
        return
    import torch.distributed as dist

    from tokpipe_compiler.runtime.process_group import init_process_group_from_env

    init_process_group_from_env(args.device)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    yield group
    # only after success: tearing down after a failure can block on a broken peer
    dist.destroy_process_group(group)


def wait_for_each_other(group: Any) -> None:
    """Every rank of the command's `group` here (nothing in one process)."""
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def gathered(result: dict[str, Any], group: Any) -> dict[str, Any]:
    """Every rank's memory table and profile paths, in rank order, for rank 0 to print
    (under torchrun no launcher collects the ranks' results)."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (result["memory"], result.get("traces", [])), group=group)
    every = {"memory": "\n".join(memory for memory, _ in parts)}
    traces = [path for _, paths in parts for path in paths]
    return {**every, "traces": traces} if traces else every


def print_on(rank: int) -> Callable[[str], None]:
    """A print to stderr on rank 0 (the others stay quiet: they run the same steps)."""
    def say(text: str) -> None:
        if rank == 0:
            print(text, file=sys.stderr, flush=True)
    return say


@contextmanager
def one_line_warnings(rank: int, world: int) -> Iterator[None]:
    """Warnings as `warning (rank R): Category: message`: Python's default names a line of
    this command's code (or, on a started rank, of multiprocessing) and repeats it, which
    says nothing to someone running the command."""
    where = f" (rank {rank})" if world > 1 else ""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning{where}: {category.__name__}: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
