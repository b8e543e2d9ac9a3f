"""The transport's in-process form: 'ranks' that are threads (or one loop) of one process,
exchanging tensors through shared queues, with the same interface and errors as
`transport.DistributedTransport` (tests, and the runtime's single-process checks)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection

import torch

from tokpipe_compiler.runtime.transport import (
    MessageKey,
    RecvHandle,
    TensorSpec,
    check_timeout,
)
from tokpipe_compiler.runtime.transport_errors import recv_error


class _LocalHub:
    """Queues shared by one group of LocalTransports, keyed by (src, dst, key)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int, MessageKey], queue.SimpleQueue] = {}

    def queue(self, src: int, dst: int, key: MessageKey) -> queue.SimpleQueue:
        with self._lock:
            return self._queues.setdefault((src, dst, key), queue.SimpleQueue())


class _LocalRecv:
    def __init__(self, owner: LocalTransport, key: MessageKey, src: int, spec: TensorSpec):
        self._owner, self._key, self._src, self._spec = owner, key, src, spec
        self._queue = owner._hub.queue(src, owner.rank, key)

    def wait(self) -> torch.Tensor:
        rank = self._owner.rank
        try:
            tensor = self._queue.get(timeout=self._owner.timeout)
        except queue.Empty:
            reason = f"timed out after {self._owner.timeout:g} s"
            raise recv_error(rank, self._src, self._key, reason) from None
        if tuple(tensor.shape) != tuple(self._spec.shape) or tensor.dtype != self._spec.dtype:
            got = f"got {tuple(tensor.shape)} {tensor.dtype}"
            want = f"expected {tuple(self._spec.shape)} {self._spec.dtype}"
            raise recv_error(rank, self._src, self._key, f"{got}, {want}")
        return tensor


class LocalTransport:
    """The same interface for 'ranks' that are threads (or one loop) of one process.

    A send is complete at once (the tensor is copied into a queue), so `flush` never waits.
    """

    def __init__(self, rank: int, world_size: int, timeout: float = 60.0, hub=None):
        check_timeout(timeout)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._hub = hub if hub is not None else _LocalHub()

    @classmethod
    def group(cls, world_size: int, timeout: float = 60.0) -> list[LocalTransport]:
        hub = _LocalHub()
        return [cls(rank, world_size, timeout, hub) for rank in range(world_size)]

    def post_recv(self, key: MessageKey, src: int, spec: TensorSpec) -> RecvHandle:
        return _LocalRecv(self, key, src, spec)

    def send(self, key: MessageKey, tensor: torch.Tensor, dst: int) -> None:
        # A copy, so the receiver owns its tensor exactly as with a real transport.
        self._hub.queue(self.rank, dst, key).put(tensor.detach().clone())

    def flush(self) -> None:
        pass

    def let_sends_wait(self, peers: Collection[int]) -> None:
        """Nothing to wait for: a send here is a queued copy."""

    def close(self) -> None:
        pass
