"""A model with graph breaks on two gloo ranks: its blocks' graph runs one stage per rank,
the other graphs run as traced on every rank, and every rank returns eager's answer."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import SplitDiT, dit_inputs
from tests.fixtures.tracing import rel_error
from tokpipe_compiler.programs.distributed import DistributedProgram
from tokpipe_compiler.runtime.launch import launch

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_the_block_graph_runs_one_stage_per_rank(mode):
    for errors, programs in launch(_split_dit, 2, args=(mode,), timeout=240):
        assert max(errors) <= 1e-5
        assert programs == [DistributedProgram.__name__]
