"""A model every rank keeps on one device (GPU 0, where `set_device` was not called, or
the CPU) while rank r computes on its own GPU: rank r's outputs come back on the caller's
device, where the scheduler's update and the VAE use them. Both ends run on the CPU here;
the program is told the caller's device is the meta device, so the move is visible."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.emulated_nccl import EmulatedNccl, run_ranks
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.programs import distributed
from tokpipe_compiler.programs.distributed import DistributedProgram
from tokpipe_compiler.runtime.transport import DistributedTransport


def test_every_rank_returns_its_outputs_on_the_callers_device(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    plan = traced.program(stages=2, chunks=2, mode="stale").plan
    monkeypatch.setattr(distributed, "device_of", lambda args: torch.device("meta"))
    hub = EmulatedNccl(2)

    def rank_main(rank: int) -> list[torch.device]:
        transport = DistributedTransport(timeout=20.0, links=hub.links(rank))
        program = DistributedProgram(plan, transport=transport)
        with torch.no_grad():
            return [out.device for out in program(*traced.args())]

    for devices in run_ranks(2, rank_main):
        assert devices == [torch.device("meta")], devices
