"""A check at the end of a forward (a NaN guard, a norm) on two gloo ranks: the body runs
one stage per rank, the check on every rank's whole output; each rank returns what one
process returns."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import ChecksItsOutput, dit_inputs
from tests.fixtures.ranks import launch_cases
from tests.fixtures.tracing import rel_error

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
CHECKS = ("nan_guard", "norm")


def _outputs(check: str) -> list:
    """The outputs at three timesteps (stale after the first) and the program types."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = ChecksItsOutput(check, depth=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)
    compiled = torch.compile(model, backend=tp.backend(
        stages=2, chunks=2, mode="stale", compiler="eager", timeout=60.0), dynamic=False)
    with torch.no_grad():
        outputs = [compiled(latents, torch.tensor([t]), labels) for t in (900, 800, 700)]
        eager = model(latents, torch.tensor([900]), labels)
    flat = [out if isinstance(out, tuple) else (out,) for out in outputs]
    return [flat, rel_error(flat[0][0], eager if check != "norm" else eager[0]),
            [type(p).__name__ for p in tp.programs(compiled)]]


def _on_rank(rank: int, world: int, check: str) -> list:
    return _outputs(check)


@pytest.fixture(scope="module")
def runs() -> dict:
    return launch_cases({check: (_on_rank, (check,)) for check in CHECKS}, 2, timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_every_rank_returns_one_process_answer(check, runs):
    alone, _, _ = _outputs(check)
    for outputs, warmup_error, programs in runs[check]:
        assert programs == ["DistributedProgram"]
        assert warmup_error <= 1e-5
        for got, want in zip(outputs, alone, strict=True):
            for a, b in zip(got, want, strict=True):
                assert rel_error(a, b) <= 1e-6
