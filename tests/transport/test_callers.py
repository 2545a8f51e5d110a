"""callers: who a call counts against, and that a message must come from its caller (no sockets)."""
import grpc
import pytest

from wan_diloco.transport.callers import IDENTITY_REASONS, Callers, claimed_sender, sender_metadata, uploader
from wan_diloco.transport.handler import Rejected
from wan_diloco.transport.metrics import TransportMetrics


class Context:
    def __init__(self, metadata=(), peer="ipv4:10.0.0.7:5555"):
        self.metadata, self._peer = tuple(metadata), peer

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return self._peer


def test_the_sender_header_round_trips_quoted_and_else_the_peer_host_counts():
    odd = "learner 0/ü"
    assert claimed_sender(Context([sender_metadata(odd)])) == odd
    assert uploader(Context([sender_metadata(odd)])) == odd
    assert claimed_sender(Context()) is None
    assert uploader(Context(peer="ipv4:10.0.0.7:5555")) == uploader(Context(peer="ipv4:10.0.0.7:6666")) == \
        "peer 10.0.0.7"


def test_bind_refuses_a_message_from_someone_else_and_counts_it():
    metrics = TransportMetrics()
    callers = Callers("t" * 24, True, False, 100.0, metrics)
    callers.bind(None, "anyone")  # one shared token: anyone may be anyone
    callers.bind("learner-0", "learner-0")
    with pytest.raises(Rejected) as e:
        callers.bind("learner-0", "learner-1")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    counts = {r: metrics.identity_refusals.labels(r)._value.get() for r in IDENTITY_REASONS}
    assert counts == {"no_sender": 0, "token": 0, "certificate": 0, "message": 1}
