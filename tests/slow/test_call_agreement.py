"""A model compiled directly, on two ranks, whose ranks run other calls after a
generation's first (another timestep on one rank, a call one rank runs another way): every
rank raises naming each rank's call, where they returned a mix of the ranks' inputs."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager", "timeout": 30.0}


def _call(compiled, model, t: int) -> str | float:
    """The call's error, or its output's largest relative difference from eager."""
    latents, _, labels = dit_inputs(model, 8)
    timestep = torch.tensor([t])
    with torch.no_grad():
        try:
            out = compiled(latents, timestep, labels)
        except tp.TokpipeError as err:
            return str(err)
        expected = model(latents, timestep, labels)
    return float((out - expected).abs().max() / expected.abs().max())


def _disagree(rank: int, world: int) -> list[str | float]:
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS), dynamic=False)
    said = [_call(compiled, model, 900), _call(compiled, model, 850 if rank else 800)]
    said.append(_call(compiled, model, 900))  # a new generation: the ranks agree again
    # Rank 1 runs step 1 another way (eagerly): its step 2 meets rank 0's step 1.
    if rank == 1:
        with torch.compiler.set_stance("force_eager"):
            _call(compiled, model, 800)
    said.append(_call(compiled, model, 700 if rank else 800))
    said.append(_call(compiled, model, 900))
    return said


def test_ranks_that_run_other_calls_raise_on_every_rank():
    per_rank = launch(_disagree, 2, timeout=240)
    for said in per_rank:
        first, other_timestep, agreed, skipped, last = said
        assert first <= 1e-5 and agreed <= 1e-5 and last <= 1e-5, said
        assert "ran other calls as one pipelined call (rank 0: step 1 at timestep 800, " \
               "guidance branch 0; rank 1: step 1 at timestep 850" in other_timestep, said
        assert "rank 0: step 1 at timestep 800, guidance branch 0; rank 1: step 1 at " \
               "timestep 700" in skipped, said
