"""Step callbacks and cancels of a parallelized pipeline on two gloo ranks: each rank's
callback sees one process's latents, an interrupt or a raise on one rank ends the
generation on every rank alike, and a cancel from another thread runs the ring to its end
(within 1e-5 relative of one process, float32). The runs share one launch
(tests/fixtures/ranks.py)."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import FAMILIES, generate
from tests.fixtures.ranks import launch_cases, selected

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
pytest.importorskip("transformers")

OPTIONS = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def _callbacks(rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """What step-end callbacks see: a ring's steps, a ring interrupted at step 1, and cfg=2's
    steps (each branch on its own rank)."""
    seen: list[torch.Tensor] = []

    def keep(pipe, i, t, tensors, interrupt_at=None):
        seen.append(tensors["latents"].clone())
        pipe._interrupt = i == interrupt_at
        return tensors

    pipe, kwargs = FAMILIES["flux"]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    ring = generate(pipe, {**kwargs, "callback_on_step_end": keep}, steps=4)
    interrupted = generate(pipe, {**kwargs, "callback_on_step_end":
                                  lambda *a: keep(*a, interrupt_at=1)}, steps=4)
    ring_seen, seen[:] = torch.stack(seen), []
    cfg, cfg_kwargs = FAMILIES["wan"]()
    tp.pipelines.parallelize(cfg, cfg=2, stages=1, compiler="eager")
    generate(cfg, {**cfg_kwargs, "callback_on_step_end": keep}, steps=4)
    cfg_seen, seen[:] = torch.stack(seen), []
    # per call (Wan passes its timestep as `t.expand(batch)`: at batch 1, stride 0)
    per_call, per_call_kwargs = FAMILIES["wan"]()
    tp.pipelines.parallelize(per_call, ring=False, **OPTIONS)
    out = generate(per_call, {**per_call_kwargs, "callback_on_step_end": keep}, steps=4)
    return [ring_seen, ring, interrupted, cfg_seen, torch.stack(seen), out,
            _after_a_cancel(pipe, kwargs)]


def _after_a_cancel(pipe, kwargs) -> torch.Tensor:
    """A callback that raises KeyboardInterrupt (a server's cancel; asyncio's
    CancelledError is a BaseException too) mid-ring: raised on every rank once the ring
    ran, and the next generation runs as ever."""
    def cancel(pipe, i, t, tensors):
        if i == 1:
            raise KeyboardInterrupt
        return tensors

    try:
        generate(pipe, {**kwargs, "callback_on_step_end": cancel}, steps=4)
    except KeyboardInterrupt:
        return generate(pipe, kwargs, steps=4)
    raise AssertionError("the callback's KeyboardInterrupt was not raised")


def test_step_callbacks_on_two_ranks(two_rank_runs):
    """Every rank's callback sees each step's latents as one process's does (the rank that
    computes them as each step is done, the other after the ring), and an interrupt ends
    the generation at its step on both; cfg=2 and per call likewise. A callback's
    KeyboardInterrupt is raised on both ranks after the ring, and the next generation
    equals one process's."""
    alone = _callbacks()
    assert alone[0].shape[0] == 4 + 2 and alone[3].shape[0] == alone[4].shape[0] == 4
    for result in two_rank_runs["callbacks"]:
        for got, want in zip(result, alone, strict=True):
            assert got.shape == want.shape
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _thread_cancel(rank: int, world: int) -> tuple[torch.Tensor, list[str]]:
    """A cancel set from outside the loop (here while it runs on probes, as a thread would
    set it), with no step callback, on every rank."""
    from tokpipe_compiler.pipelines import ring_call

    pipe, kwargs = FAMILIES["flux"]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    probe = ring_call.probe

    def cancelling(structure, step, *args):
        pipe._interrupt = pipe._interrupt or step == 2
        return probe(structure, step, *args)

    ring_call.probe = cancelling
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latents = generate(pipe, kwargs, steps=4)
    finally:
        ring_call.probe = probe
    return latents, [str(w.message) for w in caught]


def test_a_cancel_from_outside_the_loop_on_two_ranks_runs_the_ring_to_its_end(two_rank_runs):
    """Each rank would see another thread's cancel at another step and return another
    step's latents (0.2 apart): on several ranks the ring runs to its end, on every rank,
    and says so (the uncancelled generation's latents, as one process makes them)."""
    pipe, kwargs = FAMILIES["flux"]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    serial = generate(pipe, kwargs, steps=4)
    for latents, said in two_rank_runs["thread cancel"]:
        assert (latents - serial).abs().max().item() <= 1e-5 * serial.abs().max().item()
        assert any("interrupt was set while its ring ran on several ranks" in m for m in said)


# Where each rank's callback interrupts (step by rank): a cancel that reached one rank.
ONE_RANK_ENDS = {"wan22": {0: 0}, "flux": {1: 1}, "flux both": {0: 2, 1: 1}}


def _one_rank_ends(rank: int = 0, world: int = 1) -> list[Any]:
    """Step callbacks that interrupt on one rank only, or at another step on each, and one
    that raises on rank 0 only; then a generation without callbacks. One process
    interrupts where the earliest rank does."""
    def interrupting(at: dict[int, int]):
        step = min(at.values()) if world == 1 else at.get(rank)

        def callback(pipe, i, t, tensors):
            pipe._interrupt = pipe._interrupt or i == step
            return tensors
        return callback

    def failing(pipe, i, t, tensors):
        if rank == 0 and i == 1:
            raise ValueError("the request was cancelled")
        return tensors

    results: list[Any] = []
    for name, at in ONE_RANK_ENDS.items():
        pipe, kwargs = FAMILIES[name.split()[0]]()
        tp.pipelines.parallelize(pipe, **OPTIONS)
        results.append(generate(pipe, {**kwargs, "callback_on_step_end": interrupting(at)},
                                steps=4))
    start = time.monotonic()
    try:
        generate(pipe, {**kwargs, "callback_on_step_end": failing}, steps=4)
        results.append("returned")
    except (ValueError, tp.TokpipeError) as err:
        results.append(f"{type(err).__name__}: {err}")
    results += [time.monotonic() - start, generate(pipe, kwargs, steps=4)]
    return results


def test_callbacks_that_end_a_generation_on_one_rank_end_it_on_every_rank(two_rank_runs):
    """A cancel that reached one rank (its callback interrupts, or raises): the ranks
    returned other images (Flux, an interrupt at step 0 on rank 0 only: 0.46 apart), and
    where a second expert takes over (Wan 2.2) the rank that went on waited for the other's
    ring, then raised a wrong account. Every rank now ends at the earliest interrupted
    step, with the latents one process returns there; a raise on one rank ends the call on
    every rank, at once, and the next generation runs as ever."""
    alone = _one_rank_ends()
    for rank, result in enumerate(two_rank_runs["one rank ends"]):
        for got, want in zip(result[:3], alone[:3], strict=True):
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        said, seconds, after = result[3:]
        want_said = "ValueError: the request was cancelled" if rank == 0 else \
            "PeerStopped: the step callback of rank 0 raised"
        assert said.startswith(want_said), said
        assert seconds < 60 and (after - alone[5]).abs().max() <= 1e-5 * alone[5].abs().max()


@pytest.fixture(scope="module")
def two_rank_runs(request) -> dict:
    """Per-rank results of the selected two-rank runs, from one launch."""
    cases = {}
    if selected(request, test_step_callbacks_on_two_ranks):
        cases["callbacks"] = (_callbacks, ())
    if selected(request,
                test_a_cancel_from_outside_the_loop_on_two_ranks_runs_the_ring_to_its_end):
        cases["thread cancel"] = (_thread_cancel, ())
    if selected(request,
                test_callbacks_that_end_a_generation_on_one_rank_end_it_on_every_rank):
        cases["one rank ends"] = (_one_rank_ends, ())
    return launch_cases(cases, 2, timeout=600 * len(cases))
