"""Faults a service meets on two gloo ranks: requests the ranks' held programs answer
differently (each disagreement raises at once, the next agreeing request runs), a timeout
(gloo closes the group for good: later calls say the ranks must restart), and ring inputs
that differ between ranks (named as the transformer's call names them); a stall in a
parallelized ring, named as the wait that timed out."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.slow.test_faults import (
    FAULT_TIMEOUT,
    OPTIONS,
    RING_STEPS,
    check_bounded,
    inject,
    run_fault,
    timed,
)
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def serving_disagreements(rank: int, world: int) -> list[tuple[str, float]]:
    """A parallelized pipeline serving requests where the ranks' held programs differ: a
    request new to one rank only, in disagreement, then agreeing requests that one rank
    must plan alone. Returns (outcome, seconds) per request."""
    from tokpipe_compiler.generate import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    tp.pipelines.parallelize(pipe, stages=world, **{**OPTIONS, "timeout": 20.0})
    requests = [([1], [1]), ([1], [1, 2]), ([1], [1]), ([1, 2, 3], [1, 2]), ([1, 2], [1, 2])]
    outcomes, first = [], None
    for labels in requests:
        start = time.monotonic()
        try:
            out = torch.as_tensor(pipe(class_labels=labels[rank], output_type="latent",
                                       num_inference_steps=3,
                                       generator=torch.Generator().manual_seed(0)).images)
            first = out if first is None else first
            outcome = "same" if out.shape == first.shape and torch.equal(out, first) else "ran"
        except tp.TokpipeError as err:
            outcome = str(err)
        outcomes.append((outcome, time.monotonic() - start))
    return outcomes


def test_ranks_holding_other_programs_disagree_at_once_and_serve_on():
    """A rank that holds a program for its request while the other must plan one: both
    used to wait out the timeout (one for rank 0's rates, one for fingerprints keyed by
    each program's own call count), and the timeout closed gloo's pairs for good."""
    for outcomes in launch(serving_disagreements, 2, timeout=300):
        (first, _), (one_new, t1), (again, _), (both_new, t3), (alone, t4) = outcomes
        assert first == "same" and again == "same", outcomes
        for error, seconds in ((one_new, t1), (both_new, t3)):
            assert "the ranks disagree at a generation's first call" in error, error
            assert seconds < 15, outcomes
        assert alone == "ran" and t4 < 15, outcomes


def after_a_timeout(rank: int, world: int) -> list[str]:
    """Rank 0 begins a generation rank 1 joins only after rank 0's timeout; then both call
    again. Returns each call's error."""
    torch.manual_seed(0)
    model = TinyDiT(depth=world, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=world, **OPTIONS),
                             dynamic=False)
    latents, _, labels = dit_inputs(model, 8)
    errors = []
    for call in range(3):
        if call == 1 and rank == 1:
            time.sleep(2 * FAULT_TIMEOUT)
        start = time.monotonic()
        try:
            with torch.no_grad():
                compiled(latents, torch.tensor([900]), labels)
            errors.append("no error")
        except tp.TokpipeError as err:
            errors.append(f"{err} [{time.monotonic() - start:.1f} s]")
        tp.reset(compiled)
    return errors


def test_after_a_timeout_every_later_call_says_the_ranks_must_restart():
    """gloo closes a pair for good after a failed wait: the timeout says so, and later
    calls name that first failure, not 'check that rank 1 is alive' (both are)."""
    for rank, errors in enumerate(launch(after_a_timeout, 2, timeout=120)):
        first, failed, later = errors
        assert first == "no error", errors
        assert "closes a connection for good" in failed, errors
        assert "restart the ranks" in later and "since an earlier failure" in later, errors
        assert "Check that rank" not in later, errors
        assert float(later.rsplit("[", 1)[1].split()[0]) < 1.0, (rank, later)


def other_class_labels(rank: int, world: int) -> list[str]:
    """A ring where rank 1 asks for another class: the warnings each rank gives."""
    from tokpipe_compiler.generate import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    tp.pipelines.parallelize(pipe, stages=world, **{**OPTIONS, "timeout": 20.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe(class_labels=[1 + rank], output_type="latent", num_inference_steps=3,
             generator=torch.Generator().manual_seed(0))
    return [str(w.message) for w in caught if "differ between ranks" in str(w.message)]


def test_a_ring_input_that_differs_between_ranks_is_named_as_the_call_names_it():
    """The ring's fixed inputs were named by position ('input_0'), then by the ring's name
    for them ('input_class_labels'); the warning, once a call (it came at the generation's
    first call and again at its ring run)."""
    for lines in launch(other_class_labels, 2, timeout=120):
        assert len(set(lines)) == 1, lines
        assert "where several do): the transformer's 'class_labels'. Pass the same inputs " \
            "on every rank" in lines[0], lines


def other_schedule(rank: int, world: int, what: str) -> str:
    """A ring where rank 1 runs another guidance scale or scheduler shift: its error."""
    from diffusers import DPMSolverMultistepScheduler

    from tokpipe_compiler.generate import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    if what == "scheduler" and rank == 1:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config,
                                                          timestep_spacing="trailing")
    if what == "class" and rank == 1:
        pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    tp.pipelines.parallelize(pipe, stages=world, **{**OPTIONS, "timeout": 20.0})
    guidance = 4.0 + (rank if what == "guidance" else 0)
    try:
        pipe(class_labels=[1], guidance_scale=guidance, output_type="latent",
             num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    except tp.TokpipeError as err:
        return str(err)
    return "no error"


def test_ranks_with_other_guidance_scales_raise_on_every_rank():
    """They warned, and every rank got one generation mixed from both (SD3: 3.9e-2 off
    rank 0's own serial run)."""
    for error in launch(other_schedule, 2, timeout=120, args=("guidance",)):
        assert error.startswith("the ranks run different schedules"), error
        assert "input 'guidance': checksum rank 0" in error, error


@pytest.mark.parametrize(("what", "rank_1"), [("scheduler", "DDIMScheduler (configuration"),
                                              ("class", "DPMSolverMultistepScheduler")])
def test_ranks_with_other_schedulers_raise_naming_them(what, rank_1):
    """Another configuration warned and mixed the schedules (SD3 with shift 3 and 5: 3.3e-2
    and 2.8e-3 off each rank's own serial run); another class raised with a dozen of the
    programs' internal differences, none naming the scheduler."""
    for error in launch(other_schedule, 2, timeout=120, args=(what,)):
        first = "the ranks' pipelines differ at a generation's first call:\n  pipeline " \
                "'scheduler': rank 0 DDIMScheduler (configuration "
        assert error.startswith(first), error
        assert f"rank 1 {rank_1}" in error and "plan 'token input'" not in error, error


def pipeline_rank(rank: int, world: int, faulty: int, fault: str) -> None:
    """A parallelized pipeline (its loop one ring): a healthy call, then one where
    `faulty`'s stage fails at its second stage call."""
    from tokpipe_compiler.generate import tiny_dit_pipeline
    from tokpipe_compiler.stage_programs.distributed import DistributedProgram

    pipe = tiny_dit_pipeline()
    tp.parallelize(pipe, stages=world, **OPTIONS)

    def call():
        return pipe(class_labels=[1], output_type="latent", num_inference_steps=RING_STEPS,
                    generator=torch.Generator().manual_seed(0))

    call()
    if rank == faulty:
        inject(DistributedProgram, fault, after=1)
    dist.barrier()
    timed(call)


def test_a_stall_in_a_parallelized_ring_is_named_as_the_wait_that_timed_out():
    """The pipeline's leave, which the failed group cannot carry, used to take the place of
    the timeout's error (`cannot exchange the fingerprint of a peer's leaving`) and hide
    what was waited for and the advice."""
    errors, _ = run_fault(pipeline_rank, 2, 1, "stalls")
    check_bounded(errors, 1, 2, "stalls")
    message = errors[0][0]
    assert "a peer's leaving" not in message and "Check that rank 1 is alive" in message
