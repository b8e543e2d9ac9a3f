"""Faults across gloo ranks: a rank that dies or stalls in its stage (first, middle or last,
per call and in a ring) makes every other rank raise a TokpipeError within the timeout that
names the rank, stage, step and value it waited for, never a gloo abort (ranks that
disagree: test_rank_disagreement.py)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.rings import per_step, step_ring
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# Each case starts its ranks (most of its 20-40 s). CI runs one case of each kind of fault
# (a stall and a death, per call and in a ring, two ranks and three); the other
# placements run with `-m full`.
FULL = pytest.mark.full

FAULT_TIMEOUT = 3.0
OPTIONS = {"chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager",
           "timeout": FAULT_TIMEOUT}
RING_STEPS = 3


def inject(program, fault: str, after: int = 0) -> None:
    """This rank's stage dies (exit code 3) or stalls from its `after`-th run on (`program`
    a class: its programs' runs)."""
    calls = {"n": 0}
    run_stage = program._run_stage

    def faulty(*args):
        calls["n"] += 1
        if calls["n"] > after:
            if fault == "dies":
                os._exit(3)
            time.sleep(3600)
        return run_stage(*args)

    program._run_stage = faulty


def timed(fn) -> object:
    """Runs fn; a TokpipeError gains how long this rank waited: '[waited 3.01 s]'."""
    start = time.monotonic()
    try:
        return fn()
    except tp.TokpipeError as e:
        raise tp.TokpipeError(f"{e} [waited {time.monotonic() - start:.2f} s]") from None


def per_call_rank(rank: int, world: int, faulty: int, fault: str) -> None:
    torch.manual_seed(0)
    model = TinyDiT(depth=world, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=world, **OPTIONS), dynamic=False)
    latents, _, labels = dit_inputs(model, 8)
    with torch.no_grad():
        compiled(latents, torch.tensor([900]), labels)  # every rank healthy
        (program,) = tp.programs(compiled)
        if rank == faulty:
            inject(program, fault)
        dist.barrier()  # start the clocks together
        timed(lambda: compiled(latents, torch.tensor([800]), labels))


def ring_rank(rank: int, world: int, faulty: int, fault: str) -> None:
    """A healthy ring run, then one where `faulty`'s stage fails at the last ring step."""
    ring, first = step_ring(world, **OPTIONS)
    steps = per_step(RING_STEPS)
    ring.run(first, per_step=steps)
    if rank == faulty:  # its runs: one warmup, then `chunks` per ring step
        inject(ring.program, fault, after=1 + (RING_STEPS - 2) * OPTIONS["chunks"])
    dist.barrier()
    timed(lambda: ring.run(first, per_step=steps))


def waits(text: str) -> dict[int, tuple[str, float]]:
    """Each failed rank's TokpipeError and how long it waited, from launch's report."""
    found = {}
    for rank, body in re.findall(r"--- rank (\d+) ---\n(.*?)(?=\n--- rank |\Z)", text, re.S):
        match = re.search(r"TokpipeError: (.*) \[waited ([\d.]+) s\]", body, re.S)
        if match:
            found[int(rank)] = (match.group(1), float(match.group(2)))
    return found


def run_fault(fn, world: int, faulty: int, fault: str) -> tuple[dict, float]:
    start = time.monotonic()
    with pytest.raises(tp.TokpipeError) as info:
        launch(fn, world, args=(faulty, fault), timeout=300)  # starting ranks on a busy machine
    return waits(str(info.value)), time.monotonic() - start


def check_bounded(errors: dict, faulty: int, world: int, fault: str) -> None:
    """Every other rank raised a named TokpipeError, within the timeout (a stall: after it)."""
    others = [r for r in range(world) if r != faulty]
    assert set(others) <= set(errors), errors
    for rank in others:
        message, waited = errors[rank]
        assert f"rank {rank} (stage {rank})" in message or f"rank {rank} sending" in message
        assert "step" in message
        assert "Received data size" not in message
        assert waited < FAULT_TIMEOUT + 5, (rank, waited, message)  # a loaded machine
    if fault == "stalls":  # the first to notice waited the whole timeout
        assert min(errors[r][1] for r in others) > FAULT_TIMEOUT - 0.5


OUTPUT = re.compile(r"waiting for stage (\d)'s output '\w+' of step \d+ \(all chunks\) "
                    r"from rank \1")
LAST_CARRY = re.compile(rf"waiting for step {2 * RING_STEPS - 1} chunk \d+ '\w+' from rank 1")


@pytest.mark.parametrize("fault", ["stalls", "dies"])
def test_last_stage_fault_per_call_raises_on_the_others(fault):
    errors, elapsed = run_fault(per_call_rank, 2, 1, fault)
    check_bounded(errors, 1, 2, fault)
    message = errors[0][0]
    assert OUTPUT.search(message), message
    reason = "timed out after 3 s" if fault == "stalls" else "the peer has likely died"
    assert reason in message
    assert elapsed < 240  # mostly starting the ranks (each rank's wait is bounded above)


@pytest.mark.parametrize("fault", [pytest.param("stalls", marks=FULL), "dies"])
def test_last_stage_fault_at_the_last_ring_step(fault):
    errors, elapsed = run_fault(ring_rank, 2, 1, fault)
    check_bounded(errors, 1, 2, fault)
    # rank 0 got every carried chunk and waits for the output; or, where the dying rank's
    # last carry never left it (gloo sends once the receive's notice reached the sender's
    # thread), for that chunk of the last step
    assert OUTPUT.search(errors[0][0]) or LAST_CARRY.search(errors[0][0]), errors[0][0]
    assert elapsed < 240  # mostly starting the ranks (each rank's wait is bounded above)


@pytest.mark.parametrize(("faulty", "fault"), [
    (0, "stalls"), (1, "dies"), pytest.param(1, "stalls", marks=FULL),
    pytest.param(2, "dies", marks=FULL)])
def test_any_stage_of_three_fails_every_other_rank_in_time(faulty, fault):
    errors, elapsed = run_fault(per_call_rank, 3, faulty, fault)
    check_bounded(errors, faulty, 3, fault)
    if faulty == 2:
        for rank in (0, 1):
            assert OUTPUT.search(errors[rank][0]), errors[rank][0]
    assert elapsed < 240  # mostly starting the ranks (each rank's wait is bounded above)


@pytest.mark.parametrize("faulty", [pytest.param(0, marks=FULL), 1])
def test_first_or_middle_stage_dies_in_a_ring_of_three(faulty):
    errors, elapsed = run_fault(ring_rank, 3, faulty, "dies")
    check_bounded(errors, faulty, 3, "dies")
    assert elapsed < 240  # mostly starting the ranks (each rank's wait is bounded above)
