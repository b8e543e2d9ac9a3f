"""The process group around a pipeline: started by tokpipe at the first call (a rank that
never comes fails it within the timeout), and destroyed and started anew between
generations (on the same port or another, for a pipeline parallelized before or after)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.rings import per_step, step_ring
from tests.slow.test_faults import FAULT_TIMEOUT, OPTIONS
from tokpipe_compiler.runtime.launch import _free_port, launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def first_of_two(rank: int, world: int) -> tuple[str, float]:
    """Rank 0 of two whose rank 1 never starts, the group left to tokpipe (launch's group of
    one is destroyed first and restored after): the first call's error and its time."""
    dist.destroy_process_group()
    os.environ["WORLD_SIZE"] = "2"
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(**OPTIONS, stages=2), dynamic=False)
    start = time.monotonic()
    try:
        with torch.no_grad():
            compiled(*dit_inputs(model, 8))
        outcome = "no error"
    except tp.TokpipeError as err:
        outcome = str(err)
    seconds = time.monotonic() - start
    os.environ["WORLD_SIZE"] = "1"
    dist.init_process_group("gloo")  # for launch to end
    return outcome, seconds


def test_a_rank_that_never_starts_fails_the_group_tokpipe_starts_within_the_timeout():
    """It waited torch's 30 minutes, not the timeout option."""
    (error, seconds), = launch(first_of_two, 1, timeout=60)
    assert error.startswith(f"rank 0 waited {FAULT_TIMEOUT:g} s for the 2 ranks (WORLD_SIZE) "
                            "to join the process group at 127.0.0.1:"), error
    assert ", and rank 1 did not (" in error and "have each call the pipeline" in error
    assert seconds < 30, seconds  # compiling, then the timeout


PIPELINE_TIMEOUT = 10.0


def parallelized() -> object:
    from tokpipe_compiler.generate import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    pipe.set_progress_bar_config(disable=True)
    tp.pipelines.parallelize(pipe, stages=2, **{**OPTIONS, "timeout": PIPELINE_TIMEOUT})
    return pipe


def generation(pipe) -> torch.Tensor:
    return torch.as_tensor(pipe(class_labels=[1], output_type="latent", num_inference_steps=3,
                                generator=torch.Generator().manual_seed(0)).images)


def timed_out(rank: int, pipe) -> str:
    """A generation rank 1 comes to after rank 0's timeout: the error (gloo then closes the
    group's connections for good)."""
    if rank == 1:
        time.sleep(PIPELINE_TIMEOUT + 2)
    try:
        generation(pipe)
    except tp.TokpipeError as err:
        return str(err)
    return "no error"


def start_anew(rank: int, marker: Path, new_port: bool, backend: str | None = "gloo") -> None:
    """Destroys the process group and starts another with `backend`, on a new port (agreed
    in the old group) or the same. The other ranks start theirs once rank 0 has destroyed
    its own: rank 0 serves the port's store, and a rank that comes before joins the old
    one."""
    if new_port:
        port = [_free_port()]
        dist.broadcast_object_list(port)
        os.environ["MASTER_PORT"] = str(port[0])
    dist.destroy_process_group()
    if rank == 0:
        marker.touch()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.init_process_group(backend, timeout=timedelta(seconds=30))


def started_anew(rank: int, world: int, folder: Path) -> tuple[list[torch.Tensor], str]:
    """A generation, then one after each start of a new group (`fresh`: of a pipeline
    parallelized in the new group; `after a timeout`: which ended the old group's
    connections); the timeout's error."""
    pipe = parallelized()
    outputs, error = [generation(pipe)], ""
    steps = ["same port", "same port", "new port", "fresh", "same port", "after a timeout"]
    for step, how in enumerate(steps):
        if how == "after a timeout":
            error = timed_out(rank, pipe)
        start_anew(rank, folder / f"destroyed_{step}", how == "new port")
        if how == "fresh":
            pipe = parallelized()
        outputs.append(generation(pipe))
    return outputs, error


def test_a_group_started_anew_runs_the_next_generation(tmp_path):
    """On the same port the next generation waited out the timeout: tokpipe held the old
    groups (and after a failure its unfinished sends), and with them the store that the
    new group, on that port, took over."""
    for outputs, error in launch(started_anew, 2, args=(tmp_path,), timeout=180):
        assert "closes a connection for good" in error, error
        for output in outputs[1:]:
            assert torch.equal(output, outputs[0])


def in_groups_without_gloo_named(rank: int, world: int, folder: Path) -> list[torch.Tensor]:
    """A generation in launch's gloo group, then one of a pipeline parallelized in a group
    started with no backend named, then in one with gloo named per device."""
    outputs = [generation(parallelized())]
    for step, backend in enumerate([None, "cpu:gloo"]):
        start_anew(rank, folder / f"destroyed_{step}", True, backend)
        outputs.append(generation(parallelized()))
    return outputs


def test_a_group_started_without_naming_gloo_runs_the_generation(tmp_path):
    """`init_process_group()` with no backend (torchrun's usual call; its backend is
    "undefined": gloo for CPU tensors) or "cpu:gloo": every call waited out the timeout
    for its first message ("check that rank 1 is alive"), the transport taking the group
    for one that is not gloo and polling sends gloo completes only in wait()."""
    for outputs in launch(in_groups_without_gloo_named, 2, args=(tmp_path,), timeout=120):
        for output in outputs[1:]:
            assert torch.equal(output, outputs[0])


def ring_in_a_group_started_anew(rank: int, world: int, folder: Path) -> str:
    """A Ring given a group, run, then run again once every group is started anew: the
    error (which said to run as many steps on every rank)."""
    ring, first = step_ring(2, **OPTIONS, group=dist.new_group([0, 1]))
    ring.run(first, per_step=per_step(3))
    start_anew(rank, folder / "destroyed", new_port=True)
    try:
        ring.run(first, per_step=per_step(3))
    except tp.TokpipeError as err:
        return str(err)
    return "no error"


def test_a_ring_given_a_destroyed_group_says_to_make_it_anew(tmp_path):
    for error in launch(ring_in_a_group_started_anew, 2, args=(tmp_path,), timeout=120):
        assert error == ("the process group this pipeline was made for has been destroyed: "
                         "make the pipeline (or Ring) anew over the group started after it")


def ring_in_a_group_of_one(rank: int, world: int) -> tuple[list[str], torch.Tensor]:
    """A two-stage ring given the group of this rank alone: its warnings and its result."""
    mine = [dist.new_group([peer]) for peer in range(world)][rank]  # collective: both made
    ring, first = step_ring(2, **OPTIONS, group=mine)
    with pytest.warns(UserWarning) as caught:
        out = ring.run(first, per_step=per_step(3))
    return [str(w.message) for w in caught], out[0] if isinstance(out, tuple) else out


def test_a_ring_given_a_group_of_one_rank_says_its_stages_run_in_this_process():
    """Not silently: the group was meant to spread the stages over ranks."""
    (said, mine), (_, other) = launch(ring_in_a_group_of_one, 2, timeout=120)
    assert any("the process group given has one rank, so all stages=2 run in this process"
               in text for text in said), said
    torch.testing.assert_close(mine, other, rtol=0, atol=0)  # each rank ran the whole ring
