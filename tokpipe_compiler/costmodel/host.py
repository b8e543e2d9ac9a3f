"""Host time: what the CPU spends issuing a stage's work, which the GPU waits for whenever
the host falls behind it.

A stage-chunk call costs the device its kernels' time and the host the kernels' launches
plus the runtime's own bookkeeping for the call; the call takes the longer of the two (the
host queues launches ahead of the device until one of them is the bottleneck). Run a step
per call (not as a ring), each call of the compiled model also costs the host its set-up
before the first chunk (Dynamo's guards, the prelude's launches, the executor's set-up, the
output's assembly), time in which the device has nothing queued; a ring pays it once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class HostModel:
    """per_launch_s: each kernel launched from Python. per_call_s: each stage-chunk call's
    bookkeeping (with CUDA graphs, the replay and its input copies' launches).
    per_model_call_s: each call of the compiled model's set-up, which the device waits for
    when each call is one step."""

    per_launch_s: float = 0.0
    per_call_s: float = 0.0
    per_model_call_s: float = 0.0

    def call_seconds(self, launches: float) -> float:
        """Host seconds of one stage-chunk call that launches `launches` kernels."""
        return self.per_call_s + launches * self.per_launch_s

    def chunk_seconds(self, device_s: float, launches: float) -> float:
        """A stage-chunk call's seconds: its device time, or its host time where longer."""
        return max(device_s, self.call_seconds(launches))

    def bound(self, device_time: Callable[..., float], launches: Callable[[float], float]
              ) -> Callable[..., float]:
        """A stage's time per chunk, (n, c, text) -> seconds, with this host's floor;
        `launches(text)`: the stage's kernel launches for a chunk computing `text`."""
        if self == NO_HOST:
            return device_time

        def seconds(n: int, c: int, text: float = 1.0) -> float:
            return self.chunk_seconds(device_time(n, c, text), launches(text))

        return seconds


# A host that always keeps ahead of the device.
NO_HOST = HostModel()
# PyTorch launching kernels from Python while the GPU runs ahead (the published PipeFusion
# runs, eager PyTorch): 5 us a launch and nothing else.
EAGER_LAUNCHES = HostModel(per_launch_s=5e-6)

# tokpipe's runtime on the lent H200 machine's host, fitted to one run of
# benchmarks/gpu_pipeline.py --profile (BENCHMARKS.md, "GPU: one H200", run 3b): the
# PixArt-alpha-wide 4-block transformer, 2 stages of 50 and 53 kernel launches, steps timed
# one by one (the device idle at each step's start). 2 chunks: 6.81 ms a step, the GPU
# busy 4.87 ms, device-bound, so per_model_call_s = 6.81 - 4.87 = 1.94 ms. 8 chunks without graphs:
# 20.91 ms, host-bound: (20.91 - 1.94) ms over 16 calls of 51.5 launches on average, less
# 0.15 ms a call (the runtime's cost per chunk pass on the CPU, "Host time per step"), is
# 20 us a launch (Inductor's wrapper launching its Triton kernels, and the runtime's ops).
TOKPIPE_H200 = HostModel(per_launch_s=20e-6, per_call_s=0.15e-3, per_model_call_s=1.94e-3)
# With the cuda_graphs option a call launches one graph: the same bookkeeping plus the
# replay. At 8 chunks the graphed step (9.41 ms, GPU busy 7.02 ms) was device-bound with
# the same set-up a call, within 0.45 ms; the replay is put at 0.05 ms a stage-chunk call.
TOKPIPE_H200_GRAPHS = HostModel(per_call_s=0.2e-3, per_model_call_s=1.94e-3)


def runtime_host(device: str, cuda_graphs: bool) -> HostModel:
    """The host time chunks="auto" plans with when none is assumed: on a CUDA device,
    tokpipe's runtime as measured on the H200 machine (hosts differ, up to 2x between that
    machine's runs; it is the one measured); elsewhere none, since a CPU's per-op time is
    in its measured rates."""
    if not device.startswith("cuda"):
        return NO_HOST
    return TOKPIPE_H200_GRAPHS if cuda_graphs else TOKPIPE_H200


_ASSUMED: ContextVar[HostModel | None] = ContextVar("tokpipe_assumed_host", default=None)


@contextmanager
def assume_host(host: HostModel) -> Iterator[None]:
    """Plans made inside choose chunks="auto" with `host`'s time per call, whatever the
    device (predictions for a GPU this machine does not have)."""
    token = _ASSUMED.set(host)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def planning_host(device: str, cuda_graphs: bool) -> HostModel:
    """The assumed host, else the runtime's on `device`."""
    assumed = _ASSUMED.get()
    return assumed if assumed is not None else runtime_host(device, cuda_graphs)
