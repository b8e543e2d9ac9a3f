"""Every family at its released widths and text length (one or two blocks per depth field,
a small latent grid), batch 2 as guidance runs it, inputs by keyword as its pipeline passes
them: the token input is the latent, and sync and warmup-stale equal eager within 1e-5 of
the largest eager value, in one process and on two gloo ranks (the two-rank cases share one
launch; Flux and AuraFlow on two ranks with `-m full`).
"""

from __future__ import annotations

import functools

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.ranks import launch_cases, selected
from tokpipe_compiler import released

pytestmark = pytest.mark.slow

# One released config per family; the ~1B-parameter blocks (Flux, AuraFlow) get one block
# per depth field so a forward stays within seconds on two CPU cores.
FAMILIES = {"pixart-sigma-xl-2-1024-ms": 2, "dit-xl-2-256": 2, "sd3-medium": 2,
            "flux1-schnell": 1, "hunyuandit-v1.2": 2, "cogvideox-2b": 2, "latte-1": 2,
            "wan2.1-t2v-1.3b": 2, "ltx-video": 2, "auraflow": 1, "sana-1600m-1024px": 2}
GRIDS = {"image": (16, 16), "packed": (16, 16), "video": (2, 16, 16),
         "frames_first": (2, 16, 16), "tokens": (2, 16, 16)}


def grid(name: str) -> tuple[int, ...]:
    return GRIDS[released.family(name).layout]


# One family's model at a time: the cases of a family run one after another, and the
# released widths take up to 2 GB a model (Flux, AuraFlow).
@functools.lru_cache(maxsize=1)
def model_and_inputs(name: str) -> tuple[torch.nn.Module, dict]:
    model = released.build(name, layers=FAMILIES[name], grid=grid(name))
    return model, released.inputs(name, batch=2, grid=grid(name))


def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def pipelined_calls(name: str, mode: str) -> tuple[list[torch.Tensor], torch.Tensor, str]:
    """(outputs of three calls: the first, the same again, the first again; eager; the
    token input the plan chose). Stale: the first call is the warmup step."""
    model, inputs = model_and_inputs(name)
    options = {"stages": 2, "chunks": 2, "mode": mode, "warmup_steps": 1, "compiler": "eager",
               "timeout": 120.0}
    # Dynamo compiles a forward at most 8 times per process (then runs it eager); other
    # modules in this worker may have compiled the same model classes already.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    with torch.no_grad():
        expected = first_output(model(**inputs))
        outputs = [first_output(compiled(**inputs)) for _ in range(2)]
    return outputs, expected, tp.programs(compiled)[0].plan.token_input


def check(name: str, mode: str, outputs: list[torch.Tensor], expected: torch.Tensor,
          token_input: str) -> None:
    assert "hidden_states" in token_input, token_input
    scale = expected.abs().max().item()
    for call, got in enumerate(outputs):  # stale: warmup, then stale K/V of equal inputs
        error = (got - expected).abs().max().item()
        assert error <= 1e-5 * scale, f"{name} {mode} call {call}: {error:.3e} vs {scale:.3e}"


# One mode per family (a forward at released widths takes seconds here): stale's first call
# runs the whole sequence stage after stage (what sync runs), its second the chunked
# pipeline; sync itself on the two cheapest families.
SYNC = ("dit-xl-2-256", "sd3-medium")
# On two ranks in CI: every family but the two with ~1B-parameter blocks, the slowest here
# (their joint attention is SD3's and CogVideoX's, which run); all of them with `-m full`.
RANKS_FULL_ONLY = ("flux1-schnell", "auraflow")
RANK_CASES = [pytest.param(name, "stale", id=f"{name}-stale",
                           marks=[pytest.mark.full] if name in RANKS_FULL_ONLY else [])
              for name in FAMILIES]
CASES = [(name, mode) for name in FAMILIES
         for mode in ("stale", "sync") if mode == "stale" or name in SYNC]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_one_process(name, mode):
    check(name, mode, *pipelined_calls(name, mode))


def _on_rank(rank: int, world: int, name: str, mode: str):
    torch.set_num_threads(1)
    try:
        return pipelined_calls(name, mode)
    finally:
        model_and_inputs.cache_clear()  # the next case's model in its place


@pytest.fixture(scope="module")
def rank_runs(request) -> dict:
    """Per-rank results of every selected family on two ranks, from one launch."""
    cases = {(p["name"], p["mode"]): (_on_rank, (p["name"], p["mode"]))
             for p in selected(request, test_two_ranks)}
    return launch_cases(cases, 2, timeout=600 * len(cases))


@pytest.mark.parametrize(("name", "mode"), RANK_CASES)
@pytest.mark.ranks
def test_two_ranks(name, mode, rank_runs):
    per_rank = rank_runs[name, mode]
    for outputs, expected, token_input in per_rank:
        check(name, mode, outputs, expected, token_input)
    assert torch.equal(per_rank[0][0][1], per_rank[1][0][1])  # every rank returns it all


def test_sana_in_causal_mode_names_what_reads_later_tokens():
    """Linear attention sums over every token and the feed-forward's 3x3 convolution reads
    the next rows: stale mode keeps them in per-row caches; causal mode, exact, refuses."""
    model, inputs = model_and_inputs("sana-1600m-1024px")
    with pytest.raises(tp.TokpipeError, match="after the chunk"):
        tp.explain(model, (), inputs, stages=2, chunks=2, mode="causal", compiler="eager")
