"""Sends are completed as a run goes: over gloo a rank holds about two steps of sent tensors,
however many steps a ring runs. The runs share one launch of two ranks
(tests/fixtures/ranks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.ranks import launch_cases, selected
from tokpipe_compiler.runtime.transport import (
    SEND_LAG_STEPS,
    DistributedTransport,
    MessageKey,
    TensorSpec,
)

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

CHUNKS = 3
SPEC = TensorSpec((64 * 1024,), torch.float32)  # 256 KiB a message


def window_rank(rank: int, world: int, steps: int) -> int | bool:
    """Rank 0 sends `steps` x CHUNKS messages to rank 1, which posted every receive first
    (the most a receiver posts ahead). Rank 0 returns its most pending sends, rank 1 whether all
    arrived intact."""
    t = DistributedTransport(timeout=20.0)
    keys = [MessageKey(s, 1, c, "hidden") for s in range(steps) for c in range(CHUNKS)]
    if rank == 1:
        handles = [t.post_recv(key, 0, SPEC) for key in keys]
        dist.barrier()
        return all(torch.equal(h.wait(), torch.full(SPEC.shape, float(i)))
                   for i, h in enumerate(handles))
    dist.barrier()
    peak = 0
    for i, key in enumerate(keys):
        t.send(key, torch.full(SPEC.shape, float(i)), 1)
        peak = max(peak, t.pending_sends)
    t.flush()
    return peak


WINDOW_STEPS = (4, 40)
RING_STEPS = (4, 16)


@pytest.fixture(scope="module")
def runs(request) -> dict:
    """Per-rank results of the selected tests' runs, from one launch."""
    cases = {}
    if selected(request, test_pending_sends_stay_within_the_lag_however_many_steps):
        cases.update({("window", steps): (window_rank, (steps,)) for steps in WINDOW_STEPS})
    if selected(request, test_ring_pending_sends_do_not_grow_with_the_steps):
        cases["ring"] = (ring_pending, (RING_STEPS,))
    return launch_cases(cases, 2, timeout=240 * len(cases))


def test_pending_sends_stay_within_the_lag_however_many_steps(runs):
    for steps in WINDOW_STEPS:
        peak, intact = runs["window", steps]
        assert intact
        assert peak <= SEND_LAG_STEPS * CHUNKS, (steps, peak)


def ring_pending(rank: int, world: int, step_counts: tuple[int, ...]) -> list[int]:
    """Most sends pending on this rank during ring runs of each step count."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()

    def step(latents, timestep, c, labels):
        return (latents - c * model(latents, timestep[None], labels),)

    latents, _, labels = dit_inputs(model, 8)
    ring = tp.Ring(step, carry=["latents"], stages=2, chunks=4, mode="stale", warmup_steps=1,
                   compiler="eager", timeout=30.0)
    first = {"latents": latents, "labels": labels}
    peaks = []
    for steps in step_counts:
        per_step = {"timestep": torch.linspace(900, 100, steps).long(),
                    "c": torch.linspace(0.3, 0.1, steps)}
        if ring.program is None:
            ring.run(first, per_step=per_step)  # builds the program
        transport = ring.program.transport
        send, seen = transport.send, [0]

        def counting(key, tensor, dst, send=send, seen=seen, transport=transport):
            send(key, tensor, dst)
            seen[0] = max(seen[0], transport.pending_sends)

        transport.send = counting
        ring.run(first, per_step=per_step)
        transport.send = send
        peaks.append(seen[0])
    return peaks


def test_ring_pending_sends_do_not_grow_with_the_steps(runs):
    for peaks in runs["ring"]:
        short, long = peaks
        assert long <= short, peaks
