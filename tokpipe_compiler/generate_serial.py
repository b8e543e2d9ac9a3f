"""`tokpipe generate --compare`: the serial pipeline's side, timed on rank 0 alone.

The serial pipeline runs eager; where the stages are compiled (--compiler inductor or
max-autotune), it runs again with its transformers compiled by the same compiler, whole, so
the report can give both speedups: against what the user runs today, and against the same
compiler without pipelining (the pipelining's own share).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from tokpipe_compiler.generate_ranks import wait_for_each_other
from tokpipe_compiler.pipelines.marks import find_denoisers

Timed = Callable[[Any, dict], tuple[float, list]]  # (pipe, kwargs) -> (seconds, images)


def serial_runs(pipe: Any, kwargs: dict, short: dict, args: argparse.Namespace, rank: int,
                group: Any, timed: Timed) -> dict[str, Any] | None:
    """The unpipelined pipeline's times and eager images, on rank 0 alone (None elsewhere):
    ranks that ran it too would share the machine with the one timed. `short`: a call
    that pays the first-call costs (tracing, compiling) before each timed one."""
    runs = None
    if rank == 0:
        timed(pipe, short)
        seconds, images = timed(pipe, kwargs)
        runs = {"serial_s": seconds, "serial_images": images}
        if args.compiler != "eager":
            with _compiled_denoisers(pipe, args.compiler):
                timed(pipe, short)
                runs["serial_compiled_s"] = timed(pipe, kwargs)[0]
    wait_for_each_other(group)
    return runs


class _compiled_denoisers:
    """The pipeline's transformers compiled whole by `compiler` (torch.compile's Inductor
    modes) inside the block, the eager ones put back after it."""

    def __init__(self, pipe: Any, compiler: str):
        self.pipe, self.compiler = pipe, compiler
        self.eager = find_denoisers(pipe)

    def __enter__(self) -> None:
        mode = None if self.compiler == "inductor" else "max-autotune-no-cudagraphs"
        for name, module in self.eager.items():
            setattr(self.pipe, name, torch.compile(module, dynamic=False, mode=mode))

    def __exit__(self, *exc: object) -> None:
        for name, module in self.eager.items():
            setattr(self.pipe, name, module)


def compare_lines(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The serial runs' lines: each one's time and the pipelined run's speedup over it."""
    kind = "latent value" if args.released else "pixel"
    lines = [f"serial (eager): {result['serial_s']:.2f} s; speedup "
             f"{result['serial_s'] / result['pipelined_s']:.2f}x; largest difference "
             f"{result['difference']:.2e} of the largest {kind}"]
    if "serial_compiled_s" in result:
        lines.append(f"serial (compiled by {args.compiler}): {result['serial_compiled_s']:.2f}"
                     f" s; speedup {result['serial_compiled_s'] / result['pipelined_s']:.2f}x "
                     "(the pipelining's alone: both sides compiled alike)")
    return lines
