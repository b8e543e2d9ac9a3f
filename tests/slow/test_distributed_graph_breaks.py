"""A model with graph breaks on two gloo ranks: its blocks' graph runs one stage per rank,
the other graphs run as traced on every rank, and every rank returns eager's answer. Both
modes run in one launch (tests/fixtures/ranks.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import SplitDiT, dit_inputs
from tests.fixtures.ranks import launch_cases, selected
from tests.fixtures.tracing import rel_error
from tokpipe_compiler.stage_programs.distributed import DistributedProgram

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def _split_dit(rank: int, world: int, mode: str) -> tuple[list[float], list[str]]:
    """Relative errors against eager (stale: each input called twice) and program types."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = SplitDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(
        stages=world, chunks=2, mode=mode, compiler="eager", timeout=60.0), dynamic=False)
    errors = []
    with torch.no_grad():
        for seed, t in ((0, 900), (1, 800)):
            latents, _, labels = dit_inputs(model, 8, seed=seed)
            args = (latents, torch.tensor([t]), labels)
            for _ in range(2 if mode == "stale" else 1):
                out = compiled(*args)
            errors.append(rel_error(out, model(*args)))
    return errors, [type(p).__name__ for p in tp.programs(compiled)]


@pytest.fixture(scope="module")
def runs(request) -> dict:
    """Per-rank results of every selected mode, from one launch."""
    cases = {p["mode"]: (_split_dit, (p["mode"],))
             for p in selected(request, test_the_block_graph_runs_one_stage_per_rank)}
    return launch_cases(cases, 2, timeout=240 * len(cases))


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_the_block_graph_runs_one_stage_per_rank(mode, runs):
    for errors, programs in runs[mode]:
        assert max(errors) <= 1e-5
        assert programs == [DistributedProgram.__name__]
