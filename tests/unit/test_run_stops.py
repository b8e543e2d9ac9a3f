"""A group's store that lost its connection (its host, rank 0, died) is not called again:
each call failed alike, and c10d logged each failure with a C++ backtrace of about 17
lines on the surviving rank's stderr. A store that only timed out is called again."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tokpipe_compiler.runtime.run_stops import RunStops


class Group:
    """Stands in for a process group (weakly referenced, as RunStops holds it)."""


class Store:
    def __init__(self, error: Exception):
        self.error, self.calls = error, 0

    def set(self, key: str, value: str) -> None:
        self.calls += 1
        raise self.error

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize(("error", "calls"), [
    (dist.DistNetworkError("Connection reset by peer"), 1),
    (dist.DistStoreError("wait timeout after 8000ms"), 3),
])
def test_a_store_whose_connection_is_lost_is_not_called_again(monkeypatch, error, calls):
    store, group = Store(error), Group()
    monkeypatch.setattr(dist.distributed_c10d, "_get_process_group_store", lambda g: store,
                        raising=False)
    stops = RunStops(group)
    stops.say_call(1, 0, "step 0")
    assert stops.first_failure("rank 0 waiting") is None
    stops.stop(1, 0, RuntimeError("boom"))
    assert store.calls == calls
