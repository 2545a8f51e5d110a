"""A failed fetch of a global fragment must not kill a learner (it happened at the end of a run)."""
import concurrent.futures
import json
import queue

import grpc

from wan_diloco.core import Resync
from wan_diloco.core.final_sync import FinalSync
from wan_diloco.core.peer import Donor
from wan_diloco.runtime.learner import Learner
from wan_diloco.runtime.learner_final import final_fragment
from wan_diloco.transport import TransportError


class FakeNet:
    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.fetched: list[str] = []

    def next(self, block_s=0.0):
        return self.inbox.get(timeout=block_s) if block_s else self.inbox.get_nowait()

    def silent_s(self):
        return None  # the syncer answers

    def fetch_fragment(self, name: str) -> concurrent.futures.Future:
        self.fetched.append(name)
        return concurrent.futures.Future()


def test_failed_fragment_fetch_is_reported_and_asked_again(capsys):
    lrn = object.__new__(Learner)  # only the drain/resync bookkeeping is exercised
    lrn.m, lrn.net, lrn.donor = 1, FakeNet(), Donor(1)
    failed = concurrent.futures.Future()
    failed.set_exception(TransportError("Bulk", grpc.StatusCode.CANCELLED, "CANCELLED"))
    waiting = concurrent.futures.Future()
    lrn.pending_resync = {2: failed, 3: waiting}

    lrn.drain()

    assert lrn.pending_resync == {3: waiting}  # the failed one is dropped, the live one kept
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["warning"]
    assert "fragment 2" in events[0]["what"] and "CANCELLED" in events[0]["what"]

    lrn.handle([Resync(2, 3, 5), Resync(3, 3, 5)])  # the gap persists: ask again, once per fragment
    assert lrn.net.fetched == ["fragment/2"]


def test_final_fragment_fetch_is_retried(capsys):
    net = FakeNet()
    failed = concurrent.futures.Future()
    failed.set_exception(TransportError("Bulk", grpc.StatusCode.CANCELLED, "CANCELLED"))
    good = concurrent.futures.Future()
    good.set_result((1, 7, 300, {}))
    net.fetch_fragment = lambda name: (net.fetched.append(name), good)[1]

    assert final_fragment(net, FinalSync(0, 2), 1, ("final/1", failed), budget_s=1.0) == (1, 7, 300, {})
    assert net.fetched == ["final/1"]
    assert "final fragment 1" in capsys.readouterr().out
