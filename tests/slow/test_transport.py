"""Transports (in-process and gloo) and the launcher, including faulty ranks."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.emulated_nccl import EmulatedNccl
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime import process_group, transport
from tokpipe_compiler.runtime.launch import launch
from tokpipe_compiler.runtime.local_transport import LocalTransport
from tokpipe_compiler.runtime.process_group import init_process_group_from_env
from tokpipe_compiler.runtime.transport import (
    DistributedTransport,
    MessageKey,
    TensorSpec,
    as_bytes,
    from_bytes,
    message_tag,
    pieces,
)

SPECS = [
    TensorSpec((4, 5), torch.float32),
    TensorSpec((3, 7), torch.bfloat16),
    TensorSpec((2, 3, 4), torch.int64),
    TensorSpec((9,), torch.bool),
    TensorSpec((), torch.float64),
    TensorSpec((0, 3), torch.float16),
    TensorSpec((2560,), torch.float32),  # 10 KiB: pieces under a 1 KiB bound
]
FAULT_TIMEOUT = 3.0
HIDDEN = TensorSpec((2, 8), torch.float32)


def payload(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic data from the sender's seed, with NaN/inf/-0.0 for floats."""
    gen = torch.Generator().manual_seed(seed)
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=gen).bool()
    if not spec.dtype.is_floating_point:
        return torch.randint(-(2**40), 2**40, spec.shape, generator=gen).to(spec.dtype)
    data = torch.randn(spec.shape, generator=gen).to(spec.dtype)
    flat = data.view(-1)
    for i, special in enumerate([float("nan"), float("inf"), -0.0][: flat.numel()]):
        flat[i] = special
    return data


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def key(step: int, stage: int, chunk: int, name: str = "hidden") -> MessageKey:
    return MessageKey(step=step, stage=stage, chunk=chunk, name=name)


# In-process transport.


def test_local_roundtrip_copies_on_send():
    t0, t1 = LocalTransport.group(2, timeout=5.0)
    sent = payload(SPECS[0], seed=1)
    t0.send(key(0, 1, 0), sent, dst=1)
    expected = sent.clone()
    sent.zero_()  # the receiver owns its tensor, as with a real transport
    got = t1.post_recv(key(0, 1, 0), src=0, spec=SPECS[0]).wait()
    assert same_bits(got, expected)
    t0.flush()


def test_local_receives_posted_ahead_in_a_thread_ring():
    group = LocalTransport.group(3, timeout=5.0)
    results: dict[int, list[torch.Tensor]] = {}

    def rank_main(t: LocalTransport) -> None:
        src, dst = (t.rank - 1) % 3, (t.rank + 1) % 3
        handles = [t.post_recv(key(0, t.rank, c), src, spec) for c, spec in enumerate(SPECS)]
        for c, spec in reversed(list(enumerate(SPECS))):
            t.send(key(0, dst, c), payload(spec, seed=t.rank), dst)
        results[t.rank] = [h.wait() for h in handles]

    threads = [threading.Thread(target=rank_main, args=(t,)) for t in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    for rank in range(3):
        for spec, got in zip(SPECS, results[rank], strict=True):
            assert same_bits(got, payload(spec, seed=(rank - 1) % 3))


def test_local_timeout_names_ranks_and_message():
    _, t1 = LocalTransport.group(2, timeout=0.2)
    handle = t1.post_recv(key(3, 1, 2), src=0, spec=HIDDEN)
    start = time.monotonic()
    with pytest.raises(TokpipeError) as info:
        handle.wait()
    assert time.monotonic() - start < 2.0
    text = str(info.value)
    assert "rank 1 (stage 1) waiting for step 3 chunk 2 'hidden' from rank 0" in text
    assert "timed out after 0.2 s" in text
    assert "Check that rank 0 is alive" in text


def test_a_first_message_that_never_comes_names_both_ranks_of_its_pair():
    """Rank 1's wait for rank 0's first message said 'between ranks 1 and 1'."""
    hub = EmulatedNccl(2, connect_timeout=0.2)  # rank 0 never arrives
    with pytest.raises(TokpipeError) as info:
        DistributedTransport(timeout=1.0, links=hub.links(1))
    assert str(info.value).startswith(
        "rank 1 (stage 1) waiting for the first message between ranks 0 and 1 from rank 0: ")


def test_local_shape_mismatch_is_an_error():
    t0, t1 = LocalTransport.group(2)
    t0.send(key(0, 1, 0), torch.zeros(3), dst=1)
    with pytest.raises(TokpipeError, match=r"got \(3,\) torch.float32, expected \(2, 8\)"):
        t1.post_recv(key(0, 1, 0), src=0, spec=HIDDEN).wait()


# Pure helpers.


@pytest.mark.parametrize("tensor", [torch.tensor(7).expand(1), torch.tensor(7).expand(1, 1),
                                    torch.tensor(7.5).expand(1, 1, 1)])
def test_a_one_element_broadcast_travels(tensor):
    """A pipeline's `t.expand(batch)` at batch 1 has stride 0 yet counts as contiguous: its
    bytes (sent, or checksummed when ranks agree) are the value's."""
    assert tensor.stride()[-1] == 0
    data = as_bytes(tensor)
    assert torch.equal(from_bytes(data, TensorSpec(tuple(tensor.shape), tensor.dtype)), tensor)


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    max_bytes=st.integers(1, 4096),
    seed=st.integers(0, 2**16),
)
def test_pieces_reassemble_bit_for_bit(spec, max_bytes, seed):
    data = as_bytes(payload(spec, seed))
    parts = pieces(data, max_bytes)
    assert all(0 < p.numel() <= max_bytes for p in parts)
    joined = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    assert same_bits(from_bytes(joined, spec), payload(spec, seed))


def test_message_tags_fit_a_c_int_and_separate_pieces():
    tags = {message_tag(key(s, 1, c, n), p) for s in range(3) for c in range(4) for n in "ab"
            for p in range(3)}
    assert all(0 <= t < 2**31 for t in tags)
    assert len(tags) == 3 * 4 * 2 * 3


class FakeWork:
    """A backend work that completes `after` seconds from now (never if None)."""

    def __init__(self, after: float | None, error: str | None = None, waited: bool = True):
        self.done_at = None if after is None else time.monotonic() + after
        self.error, self.waited = error, waited

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout=None) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self.waited


@pytest.mark.parametrize(
    ("work", "reason"),
    [
        (FakeWork(None), "timed out after 0.3 s"),
        (FakeWork(0.05, "Connection closed by peer [x]:1.\nmore"), "failed (Connection closed"),
    ],
)
def test_polling_wait_is_bounded_and_reports_the_backend_error(work, reason):
    start = time.monotonic()
    with pytest.raises(transport._Failed, match=re.escape(reason)):
        transport._wait_polling(work, start + 0.3, timeout=0.3)
    assert time.monotonic() - start < 1.0


def test_polling_wait_returns_once_completed():
    start = time.monotonic()
    transport._wait_polling(FakeWork(0.05), start + 5.0, timeout=5.0)
    assert time.monotonic() - start < 1.0


def test_native_wait_treats_false_as_a_timeout():
    with pytest.raises(transport._Failed, match="timed out after 2 s"):
        transport._wait_native(FakeWork(0.0, waited=False), time.monotonic() + 2, timeout=2)


def test_distributed_transport_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(TokpipeError, match="init_process_group_from_env"):
        DistributedTransport()


def test_init_from_env_names_missing_variables(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TokpipeError, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"):
        init_process_group_from_env("cpu")


@pytest.mark.parametrize(("rank", "world", "error", "absent"), [
    (0, 2, dist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients "
                               "joined."), "rank 1"),
    (0, 4, dist.DistStoreError("Timed out after 3 seconds waiting for clients. 3/4 clients "
                               "joined."), "1 of ranks 1, 2, 3"),
    (2, 3, dist.DistNetworkError("The client socket has timed out after 3000ms while trying "
                                 "to connect to (127.0.0.1, 29500)."), "rank 0"),
    (1, 3, dist.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/2"),
     "one or more of ranks 0, 2"),
])
def test_a_rank_that_does_not_join_is_named_as_far_as_torch_tells(rank, world, error, absent):
    assert process_group._absent(error, rank, world) == absent


def test_launch_rejects_a_local_function():
    with pytest.raises(TokpipeError, match="module-level function"):
        launch(lambda rank, world: rank, 2)


# Ranks launched as processes (module-level functions, so spawn can pickle them).


def ring_rank(rank: int, world: int) -> list[torch.Tensor]:
    """Posts every receive, then a barrier, then sends in reverse order along the ring."""
    t = DistributedTransport(timeout=20.0, max_message_bytes=1024)
    src, dst = (rank - 1) % world, (rank + 1) % world
    handles = [t.post_recv(key(0, rank, c), src, spec) for c, spec in enumerate(SPECS)]
    dist.barrier()  # every receive is posted before any matching send
    for c, spec in reversed(list(enumerate(SPECS))):
        t.send(key(0, dst, c), payload(spec, seed=rank), dst)
    got = [h.wait() for h in handles]
    t.flush()
    with pytest.raises(TokpipeError, match="the tensor is on meta"):
        t.send(key(1, dst, 0), torch.empty(2, device="meta"), dst)
    return got


def faulty_rank(rank: int, world: int, fault: str) -> None:
    """Rank 1 exits or stalls; rank 0 sends to it, rank 2 receives from it."""
    t = DistributedTransport(timeout=FAULT_TIMEOUT)
    # Start the clocks together: a rank slow to start (a loaded machine) would otherwise time
    # out after launch stopped collecting the others' reports.
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)  # let the others post first
        if fault == "exit":
            os._exit(3)
        time.sleep(3600)
    start = time.monotonic()
    try:
        if rank == 0:
            t.send(key(3, 1, 2), torch.ones(HIDDEN.shape), dst=1)
            t.flush()
        else:
            t.post_recv(key(3, rank, 2), src=1, spec=HIDDEN).wait()
    except TokpipeError as e:
        raise TokpipeError(f"{e} [waited {time.monotonic() - start:.2f} s]") from None


def raising_rank(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def sleeping_rank(rank: int, world: int) -> None:
    time.sleep(3600)


def waited(text: str, what: str) -> float:
    match = re.search(re.escape(what) + r".*\[waited ([\d.]+) s\]", text)
    assert match, text
    return float(match.group(1))


SENDING = "rank 0 sending step 3 chunk 2 'hidden' to rank 1 (stage 1)"
WAITING = "rank 2 (stage 2) waiting for step 3 chunk 2 'hidden' from rank 1"


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ring_is_bit_exact_in_pieces(world):
    results = launch(ring_rank, world, timeout=60.0)
    assert len(results) == world
    for rank, got in enumerate(results):
        for spec, tensor in zip(SPECS, got, strict=True):
            assert same_bits(tensor, payload(spec, seed=(rank - 1) % world))


@pytest.mark.slow
@pytest.mark.ranks
def test_dead_rank_fails_its_peers_fast():
    start = time.monotonic()
    with pytest.raises(TokpipeError) as info:
        launch(faulty_rank, 3, args=("exit",), timeout=60.0)
    text = str(info.value)
    # The bound that matters is each rank's own wait (below); the whole launch, mostly
    # starting three interpreters, only has to end well before launch's own 60 s.
    assert time.monotonic() - start < 50
    assert "rank(s) 0, 1, 2 of 3 failed" in text
    assert "rank 1 ---\nexited with code 3" in text
    assert "Connection closed by peer" in text
    for what in (SENDING, WAITING):
        assert waited(text, what) < FAULT_TIMEOUT + 2


@pytest.mark.slow
@pytest.mark.ranks
def test_stalled_rank_times_out_its_peers():
    start = time.monotonic()
    with pytest.raises(TokpipeError) as info:
        launch(faulty_rank, 3, args=("stall",), timeout=60.0)
    text = str(info.value)
    assert time.monotonic() - start < 50  # as above: the waits below are what counts
    assert "Rank(s) 1 still running were terminated" in text
    assert "timed out after 3 s" in text
    for what in (SENDING, WAITING):
        assert FAULT_TIMEOUT - 0.5 < waited(text, what) < FAULT_TIMEOUT + 2


@pytest.mark.slow
@pytest.mark.ranks
def test_launch_reports_the_remote_traceback():
    with pytest.raises(TokpipeError) as info:
        launch(raising_rank, 2, timeout=60.0)
    text = str(info.value)
    assert "rank(s) 1 of 2 failed" in text
    assert "ValueError: boom on rank 1" in text
    assert "in raising_rank" in text


@pytest.mark.slow
@pytest.mark.ranks
def test_launch_timeout_kills_and_names_running_ranks():
    start = time.monotonic()
    with pytest.raises(TokpipeError, match=r"timed out after 4 s\.\nRank\(s\) 0, 1 still running"):
        launch(sleeping_rank, 2, timeout=4.0)
    assert time.monotonic() - start < 4.0 + 20
