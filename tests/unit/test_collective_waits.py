"""A collective's wait that fails names what the rank waited for and why, in one line."""

import pytest
import torch.distributed as dist

from tokpipe_compiler.runtime.transport_errors import TransportError, wait_collective


class FailingWork:
    def __init__(self, message: str):
        self.message = message

    def wait(self, timeout):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("message, reason", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv",
     "timed out after 3 s (Timed out waiting 3000ms for recv)"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
     "the peer has likely died"),
])
def test_a_failed_collective_wait_names_the_value_and_the_reason(monkeypatch, message, reason):
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    with pytest.raises(TransportError) as raised:
        wait_collective(FailingWork(message), 3.0, "the other guidance branch's prediction")
    text = str(raised.value)
    assert text.startswith("rank 1 waiting for the other guidance branch's prediction: ")
    assert reason in text and "gloo/transport" not in text
