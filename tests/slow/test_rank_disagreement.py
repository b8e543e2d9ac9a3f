"""Ranks that disagree across gloo ranks (shapes, options, latents, step counts, inputs a
call passes however deep, a rank that never comes) stop at the first call with a named
error on every rank, or warn where only other inputs differ; never a gloo abort."""

from __future__ import annotations

import functools
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs, timestep_features
from tests.fixtures.rings import per_step, step_ring
from tests.slow.test_faults import FAULT_TIMEOUT, OPTIONS, RING_STEPS
from tokpipe_compiler.runtime.launch import launch
from tokpipe_compiler.runtime.run_stops import group_store
from tokpipe_compiler.stage_programs.plan_reads import persistent_inputs

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

def disagreeing_rank(rank: int, world: int, what: str) -> list[str]:
    """Rank 1 differs from rank 0 in `what`; returns the warnings of the call."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    odd = rank == 1
    options = {**OPTIONS, "stages": world, "timeout": 20.0}
    if what == "options" and odd:
        options["chunks"] = 4
    batch = 2 if what == "batch" and odd else 1
    latents, t, labels = dit_inputs(model, 8, seed=1 if what == "seed" and odd else 0,
                                    batch=batch)
    if what == "labels":
        labels = torch.tensor([rank])
    if what == "timestep" and odd:
        t = t + 1
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(latents, t, labels)
    return [str(w.message) for w in caught]


class Control:
    """An object the call passes, holding a tensor."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale


class ResidualDiT(TinyDiT):
    """Takes a ControlNet's residuals as SD3 does: a list passed through **kwargs, each
    added to a block's output, scaled by a tensor an object holds."""

    def forward(self, latents, timestep, labels, **kwargs):
        b, c, h, w = latents.shape
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(timestep_features(timestep, 16)) + self.label(labels)
        for block, residual in zip(self.blocks, kwargs["residuals"], strict=True):
            x = block(x, cond) + residual * kwargs["control"].scale
        p = self.patch
        x = self.out(x).reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)


def residuals_rank(rank: int, world: int) -> tuple[list[str], list[str]]:
    """Rank 1's second residual and its control's scale differ from rank 0's; the warnings
    of the call, and the inputs its program keeps in place from call to call."""
    torch.manual_seed(0)
    model = ResidualDiT(depth=2, width=32, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    residuals = [torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(seed))
                 for seed in (0, 1 + rank)]
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS, stages=world), dynamic=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(latents, t, labels, residuals=residuals,
                 control=Control(torch.tensor([1.0 + rank])))
    persistent = persistent_inputs(tp.programs(compiled)[0].plan)
    return [str(w.message) for w in caught], sorted(persistent)


def test_list_entries_passed_through_kwargs_are_compared_between_ranks():
    """A ControlNet's residuals (SD3, Flux) were taken for weights: never compared, so
    ranks with other residuals returned one rank's image without a word, and kept in
    place between calls (CUDA graphs keyed on them); so was a tensor an object holds."""
    for caught, persistent in launch(residuals_rank, 2, timeout=120):
        assert any("inputs differ between ranks" in w and "'residuals[1]'" in w
                   and "'control.scale'" in w and "'residuals[0]'" not in w
                   for w in caught), caught
        assert not [name for name in persistent if "residuals" in name or "control" in name], \
            persistent


@functools.cache
def disagreement(what: str) -> tuple[str, float]:
    """launch's report of ranks that disagree in `what`, and the seconds it took (one launch
    per `what`: the two checks of the "seed" report read the same run)."""
    start = time.monotonic()
    with pytest.raises(tp.TokpipeError) as info:
        launch(disagreeing_rank, 2, args=(what,), timeout=120)
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize(("what", "expected"), [
    ("batch", r"input 'latents': rank 0 \(1, 4, 8, 8\) float32, rank 1 \(2, 4, 8, 8\) float32"),
    ("options", r"options 'chunks': rank 0 2, rank 1 4"),
    ("seed", r"the token input 'latents' has other values on other ranks"),
    ("seed", r"input 'latents': checksum rank 0 [0-9a-f]{8}, rank 1 [0-9a-f]{8}"),
    ("timestep", r"the ranks run different schedules[^\n]*\n  input 'timestep': checksum rank 0 "),
])
def test_ranks_that_disagree_raise_a_named_error_on_every_rank(what, expected):
    text, seconds = disagreement(what)
    assert "rank(s) 0, 1 of 2 failed" in text
    assert "--- rank 0, 1 ---\nTokpipeError: " in text, text  # the same error on both ranks
    assert len(re.findall(expected, text)) == 1, text  # reported once
    assert "EnforceNotMet" not in text and "exited with code" not in text
    assert seconds < 90


def test_other_inputs_that_differ_give_a_warning():
    for caught in launch(disagreeing_rank, 2, args=("labels",), timeout=120):
        assert any("a mix of requests where several do): 'labels'" in w
                   for w in caught), caught


def absent_rank(rank: int, world: int) -> tuple[str, float] | None:
    """Rank 1 never calls the model; rank 0 returns its error and how long it waited."""
    if rank == 1:
        return None
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS, stages=world), dynamic=False)
    start = time.monotonic()
    try:
        with torch.no_grad():
            compiled(*dit_inputs(model, 8))
    except tp.TokpipeError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_rank_that_never_calls_makes_the_others_raise_within_the_timeout():
    """Before the first call's links exist, too: not the process group's 30 minutes."""
    (text, seconds), _ = launch(absent_rank, 2, timeout=120)
    assert f"rank 0 waited {FAULT_TIMEOUT:g} s for ranks [0, 1] to start the pipeline " \
        "(their first call of it) and rank 1 never came" in text, text
    assert seconds < 60  # planning, then the timeout


def arrival_keys_left(rank: int, world: int) -> list[int]:
    """Both ranks run the model once; the ranks whose arrival key is still in the store."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS, stages=world), dynamic=False)
    with torch.no_grad():
        compiled(*dit_inputs(model, 8))
    dist.barrier()
    store = group_store(dist.group.WORLD)
    return [place for place in range(world) if store.check([f"tokpipe/arrived/{place}"])]


def test_ranks_that_all_came_take_back_their_arrival():
    """Else a group of the same name made later over the store would not name a missing
    rank: its key, left from before, says it came."""
    assert launch(arrival_keys_left, 2, timeout=120) == [[], []]


def ring_of_steps(rank: int, world: int) -> None:
    """Rank 1 runs one step more than rank 0 (another num_inference_steps)."""
    ring, first = step_ring(world, **{**OPTIONS, "timeout": 20.0})
    ring.run(first, per_step=per_step(RING_STEPS + rank))


def test_ranks_that_run_other_step_counts_are_told_at_the_first_call():
    """Not after a timeout spent waiting for a step the other rank never runs."""
    start = time.monotonic()
    with pytest.raises(tp.TokpipeError) as info:
        launch(ring_of_steps, 2, timeout=120)
    text = str(info.value)
    assert "--- rank 0, 1 ---\nTokpipeError: " in text, text  # the same error on both ranks
    assert "plan 'ring steps': rank 0 3, rank 1 4" in text, text
    assert time.monotonic() - start < 60  # rather than the 20 s timeout on both ranks


def later_rings(rank: int, world: int) -> tuple[str, str, float]:
    """Three ring runs of one program: the ranks agree, then rank 1 passes other timesteps
    after the warmup step, then it runs one step more. Returns the second run's error, the
    third's and the seconds the third took to raise."""
    ring, first = step_ring(world, **{**OPTIONS, "timeout": 20.0})
    ring.run(first, per_step=per_step(RING_STEPS))
    try:
        ring.run(first, per_step=per_step(RING_STEPS, last=100 + 100 * rank))
        timesteps = "no error"
    except tp.TokpipeError as err:
        timesteps = str(err)
    start = time.monotonic()
    try:
        ring.run(first, per_step=per_step(RING_STEPS + rank))
    except tp.TokpipeError as err:
        return timesteps, str(err), time.monotonic() - start
    return timesteps, "no error", time.monotonic() - start


def test_later_ring_runs_that_differ_between_ranks_are_told_at_once():
    """A program's later generations are checked too: other timesteps in the ring steps
    raise at the ring run (they warned, and both ranks ran one mixed schedule), another
    step count raises at once on both ranks, at the warmup step (not after the 20 s
    timeout)."""
    for timesteps, error, seconds in launch(later_rings, 2, timeout=120):
        assert timesteps.startswith("the ranks run different schedules"), timesteps
        assert re.search(r"input 'timestep': checksum rank 0 [0-9a-f]{8}, rank 1", timesteps)
        assert "the ranks disagree at a generation's first call" in error, error  # warmup
        assert "plan 'ring steps': rank 0 3, rank 1 4" in error, error
        assert "run as many steps (num_inference_steps)" in error, error
        assert seconds < 10, seconds


def later_generation(rank: int, world: int) -> tuple[str, float]:
    """Per call: a two-step generation the ranks agree on, then a new one (the timestep
    moves back) whose latents rank 1 draws from another seed. Returns the error and the
    seconds to it."""
    torch.manual_seed(0)
    model = TinyDiT(depth=world, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=world, **OPTIONS),
                             dynamic=False)
    latents, _, labels = dit_inputs(model, 8)
    with torch.no_grad():
        for t in (900, 800):
            compiled(latents, torch.tensor([t]), labels)
        other = dit_inputs(model, 8, seed=rank)[0]
        start = time.monotonic()
        try:
            compiled(other, torch.tensor([900]), labels)
        except tp.TokpipeError as err:
            return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_later_generation_with_other_latents_on_a_rank_raises_at_its_first_call():
    """Not a silent mix of the ranks' inputs: every generation's first call is checked."""
    for error, seconds in launch(later_generation, 2, timeout=120):
        assert "the token input 'latents' has other values on other ranks" in error, error
        assert seconds < FAULT_TIMEOUT, seconds


def per_call_pipeline(rank: int, world: int) -> tuple[str, float]:
    """A parallelized pipeline, per call: a 3-step generation, then one where rank 1 asks
    for a step more. Returns the error and the seconds to it."""
    from tokpipe_compiler.generate import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    tp.pipelines.parallelize(pipe, stages=world, ring=False, **{**OPTIONS, "timeout": 20.0})
    call = {"class_labels": [1], "output_type": "latent"}
    pipe(**call, num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    start = time.monotonic()
    try:
        pipe(**call, num_inference_steps=3 + rank, generator=torch.Generator().manual_seed(0))
    except tp.TokpipeError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_per_call_ranks_that_run_other_step_counts_are_told_at_once():
    """The scheduler's length joins the fingerprint: not the 20 s timeout spent waiting for
    a step the other rank never runs."""
    for error, seconds in launch(per_call_pipeline, 2, timeout=120):
        assert "plan 'scheduler steps': rank 0 3, rank 1 4" in error, error
        assert "run as many steps (num_inference_steps)" in error, error
        assert seconds < 10, seconds


def per_call_compiled(rank: int, world: int) -> str:
    """torch.compile'd directly, per call: rank 1 runs a step more in the first generation,
    then both begin another. Returns the error."""
    torch.manual_seed(0)
    model = TinyDiT(depth=world, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=world, **OPTIONS),
                             dynamic=False)
    latents, _, labels = dit_inputs(model, 8)
    try:
        with torch.no_grad():
            first_generation = [900, 800, 700, 600][: 3 + rank]
            for t in (*first_generation, 900, 800):
                compiled(latents, torch.tensor([t]), labels)
    except tp.TokpipeError as err:
        return str(err)
    return "no error"


def test_a_rank_still_in_the_last_generation_is_named_as_the_likely_cause():
    """Without a scheduler the program learns a generation's length only as it ends: the
    rank that began the next one waits out the timeout, then says why its peer may not."""
    first, second = launch(per_call_compiled, 2, timeout=120)
    assert "fingerprint of a generation's first call (options" in first, first
    assert "may still be in the last" in first and "num_inference_steps" in first, first
    assert "waiting for step 3 chunk 0" in second, second
