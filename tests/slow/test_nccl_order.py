"""The distributed runtime under NCCL's point-to-point rules, emulated with thread ranks
(tests/fixtures/emulated_nccl.py): operations of a communicator run in posting order, a
send and its receive meet, and a pair's first message creates its communicator. gloo's
tags and buffers let any posting order through; NCCL hangs on an order the two ends do
not share, and the ring of two ranks sends both ways."""

from __future__ import annotations

import copy

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.emulated_nccl import EmulatedNccl, run_ranks
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.transport import DistributedTransport, MessageKey, TensorSpec
from tokpipe_compiler.stage_programs.distributed import DistributedProgram

pytestmark = pytest.mark.slow

OPTIONS = {"mode": "stale", "warmup_steps": 1, "compiler": "eager"}
SPEC = TensorSpec((3, 5), torch.float32)


def exchange_both_ways(hub: EmulatedNccl) -> list[bool]:
    """Each of two ranks posts its receive from the other ahead, then sends to it: what a
    ring of two ranks does (rank 0 receives the carried chunks, sends the boundary)."""

    def rank_main(rank: int) -> bool:
        t = DistributedTransport(timeout=2.0, links=hub.links(rank))
        peer = 1 - rank
        received = t.post_recv(MessageKey(0, rank, 0, "x"), peer, SPEC)
        t.send(MessageKey(0, peer, 0, "x"), torch.full(SPEC.shape, float(rank)), peer)
        ok = torch.equal(received.wait(), torch.full(SPEC.shape, float(peer)))
        t.flush()
        return ok

    return run_ranks(2, rank_main)


def test_each_direction_of_a_pair_has_its_own_communicator():
    # the first messages create the pair's communicators in an order both share
    assert exchange_both_ways(EmulatedNccl(2)) == [True, True]


def test_one_communicator_for_both_directions_would_hang():
    """What the transport's two groups per pair avoid: the receive posted ahead holds back
    the send behind it on both ranks."""
    with pytest.raises(TokpipeError, match="timed out"):
        exchange_both_ways(EmulatedNccl(2, one_way=False, connect_timeout=2.0))


def dit_ring(stages: int, chunks: int, steps: int = 4):
    """A TinyDiT denoising ring, its inputs, and what one process computes."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2 * stages, width=32, heads=2, grid=8).eval()

    def step(latents, timestep, c, labels):
        return (latents - c * model(latents, timestep[None], labels),)

    latents, _, labels = dit_inputs(model, 8)
    inputs = {"latents": latents, "labels": labels}
    per_step = {"timestep": torch.linspace(900, 100, steps).long(),
                "c": torch.linspace(0.3, 0.1, steps)}
    ring = tp.Ring(step, carry=["latents"], stages=stages, chunks=chunks, **OPTIONS)
    (expected,) = ring.run(inputs, per_step=per_step)
    return ring, inputs, per_step, expected


def on_emulated_ranks(ring: tp.Ring, inputs: dict, per_step: dict,
                      hub: EmulatedNccl | None = None) -> list[torch.Tensor]:
    """The ring run by one thread rank per stage, each with its stage's program over the
    emulated NCCL (a copy of the ring holding that program for the traced signature and
    chunk table)."""
    stages = len(ring.program.plan.stages)
    hub = hub or EmulatedNccl(stages)
    (key, _), = ring._programs.items()  # (signature, chunk table) -> program

    def rank_main(rank: int) -> torch.Tensor:
        transport = DistributedTransport(timeout=20.0, links=hub.links(rank))
        mine = copy.copy(ring)
        mine._programs = {key: DistributedProgram(ring.program.plan, transport=transport)}
        return mine.run(inputs, per_step=per_step)[0]

    return run_ranks(stages, rank_main)


@pytest.mark.parametrize(("stages", "chunks"), [(2, 4), (3, 2)])
def test_ring_completes_under_nccl_rules_and_equals_one_process(stages, chunks):
    ring, inputs, per_step, expected = dit_ring(stages, chunks)
    for result in on_emulated_ranks(ring, inputs, per_step):
        assert torch.equal(result, expected)


def test_a_ring_posts_receives_a_few_steps_ahead_however_long():
    """Receive buffers posted and not yet waited for: as many at most in a ring of 12 steps
    as in one of 5 (posting a whole run's receives at once held one per value of every
    step). Posting and waiting are each rank's own actions, so the count is the same in
    every run, however the threads interleave."""
    most = []
    for steps in (5, 12):
        ring, inputs, per_step, expected = dit_ring(2, 4, steps)
        hub = EmulatedNccl(2)
        for result in on_emulated_ranks(ring, inputs, per_step, hub):
            assert torch.equal(result, expected)
        most.append(hub.most_holding)
    assert most[0] == most[1], most
    assert all(n > 0 for n in most[0]), most


def test_per_call_steps_complete_under_nccl_rules_and_equal_one_process():
    """Calls of a pipelined program: each rank's stage, then every rank's copy of the last
    stage's output, over the emulated NCCL, as one process computes them."""
    torch.manual_seed(0)
    model = TinyDiT(depth=4, width=32, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    traced = trace(model, latents, t, labels)
    calls = [traced.args(latents=latents * (1 + k / 10), timestep=t - 10 * k)
             for k in range(3)]
    alone = traced.program(stages=2, chunks=2, **OPTIONS)
    with torch.no_grad():
        expected = [alone(*args)[0] for args in calls]
    hub = EmulatedNccl(2)

    def rank_main(rank: int) -> list[torch.Tensor]:
        transport = DistributedTransport(timeout=20.0, links=hub.links(rank))
        mine = DistributedProgram(alone.plan, transport=transport)
        with torch.no_grad():
            return [mine(*args)[0] for args in calls]

    for results in run_ranks(2, rank_main):
        assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))
