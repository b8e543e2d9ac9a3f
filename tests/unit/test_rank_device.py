"""A model every rank keeps on one device (GPU 0, where `set_device` was not called, or
the CPU) while rank r computes on its own GPU: rank r's outputs come back where the caller
keeps the latents, for the scheduler's update and the VAE. Both ends run on the CPU here;
the program is told the caller's device is the meta device, so the move is visible."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.emulated_nccl import EmulatedNccl, run_ranks
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.runtime.transport import DistributedTransport
from tokpipe_compiler.stage_programs.distributed import DistributedProgram


def test_every_rank_returns_its_outputs_on_the_callers_device(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    traced = trace(model, latents, t, labels)
    plan = traced.program(stages=2, chunks=2, mode="stale").plan
    caller_device = DistributedProgram._caller_device  # the latents' device
    monkeypatch.setattr(DistributedProgram, "_caller_device",
                        lambda self, args: torch.device("meta"))
    hub = EmulatedNccl(2)

    def rank_main(rank: int) -> list[torch.device]:
        transport = DistributedTransport(timeout=20.0, links=hub.links(rank))
        program = DistributedProgram(plan, transport=transport)
        args = traced.args(latents=latents)
        assert args[program.token_position] is latents
        assert caller_device(program, args) == latents.device
        with torch.no_grad():
            return [out.device for out in program(*args)]

    for devices in run_ranks(2, rank_main):
        assert devices == [torch.device("meta")], devices
