"""Where `tokpipe generate` runs a pipeline: --device resolved and checked, each rank's GPU,
the pipeline and its call's tensors moved there, and clocks that wait for the device."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, ranks: int, cuda_graphs: bool) -> str:
    """"cpu" or "cuda" for --device ("auto": CUDA where there is a GPU), checked against
    --ranks (NCCL runs one rank a GPU) and --cuda-graphs (CUDA only)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TokpipeError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU "
                               "here; pass --device cpu (or leave --device out)")
        gpus = torch.cuda.device_count()
        if ranks > gpus:
            raise TokpipeError(f"--ranks {ranks} on CUDA needs a GPU per rank (NCCL runs one "
                               f"rank a GPU); this machine has {gpus}: pass --ranks {gpus} "
                               "or fewer, or --device cpu")
    elif cuda_graphs:
        raise TokpipeError("--cuda-graphs replays each chunk from a CUDA graph: it needs "
                           "--device cuda")
    return name


def rank_device(kind: str) -> torch.device:
    """This process's device for --device `kind`: the GPU of its LOCAL_RANK (set by --ranks
    and by torchrun) for CUDA."""
    if resolve_device(kind, 1, False) == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise TokpipeError(f"local rank {index} has no GPU of its own: this machine has "
                           f"{torch.cuda.device_count()}; start at most that many processes "
                           "a machine")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def to_device(pipe: Any, kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Moves `pipe` to `device` in place; returns the call's arguments with their tensors
    (prompt embeddings, given latents) moved too."""
    pipe.to(device)
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in kwargs.items()}


def clock() -> float:
    """Seconds, once the GPU's queued work is done: a pipeline's call returns before its
    last kernels have run when its output stays on the GPU (latents)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def busy_note() -> str | None:
    """A note for a timed run of several ranks on this machine's cores where other processes
    keep them busy: the ranks share the cores with those, which lowers the speedups."""
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy <= 0.5:
        return None
    return (f"note: the load average is {busy:.1f} before the run; other busy processes take "
            "cores from the ranks and lower the speedup (compare ratios from an idle machine)")


def say_if_busy() -> None:
    """Prints `busy_note`, where there is one, before a timed run of several ranks."""
    note = busy_note()
    if note is not None:
        print(note)
