"""The start barrier with real processes (#23, case 8): a learner that joined first takes no step before
the others joined, so a short run is not trained by one learner and reported as done by all; a barrier
not met in time fails the run naming who never joined."""
import asyncio
import json
import subprocess
import sys
import threading
import time
import types

import pytest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.core.barrier import BarrierView
from wan_diloco.runtime import serde
from wan_diloco.runtime.launch import Cluster, child_env
from wan_diloco.runtime.learner import Learner, StartTimeout
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import TransportMetrics

from .conftest import TOKEN, micro_config
from .helpers import status, wait_for


def event(child, kind):
    return next((e for e in child.events if e.get("event") == kind), None)


def barrier_config(tmp_path, need, timeout_s=600.0, steps=40):
    path = micro_config(tmp_path, learners=2, steps=steps)
    text = path.read_text().replace("[run]\n", f"[run]\nmin_learners_to_start = {need}\nstart_timeout_s = {timeout_s}\n", 1)
    path.write_text(text)
    return path


@pytest.mark.slow  # two learner start-ups one after the other: ~110 s on 2 shared cores
def test_the_first_learner_waits_for_the_second_and_both_train(tmp_path):
    path = barrier_config(tmp_path, need=2, steps=24)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncer()
        first = cluster.start_learner(0)
        waiting = wait_for("learner 0 at the barrier", lambda: next(
            (e for e in first.events if e.get("event") == "barrier" and not e["started"]), None), timeout_s=180)
        assert waiting["waiting_for"] == [1] and waiting["joined"] == [0]
        assert status(cluster)["barrier"] == {"need": 2, "joined": [0], "waiting_for": [1], "started": False}
        time.sleep(2.0)  # what it would have trained meanwhile without the barrier
        assert not any(e.get("event") in ("start", "step") for e in first.events)
        second_started_s = time.time()
        cluster.start_learner(1)
        wait_for("the end of the run", lambda: all(c.exit_code is not None for c in cluster.children.values()),
                 timeout_s=240)
        assert [c.exit_code for c in cluster.children.values()] == [0, 0, 0]
        assert event(first, "start")["t"] > second_started_s  # it started training only once learner 1 joined
        finals = [event(cluster.children[f"learner-{m}"], "final") for m in range(2)]
        assert all(f["tokens"] > 0 for f in finals)  # both trained: neither did the whole budget alone


def test_a_syncer_whose_barrier_is_not_met_in_time_exits_non_zero_naming_the_missing(tmp_path):
    path = barrier_config(tmp_path, need=2, timeout_s=2.0)
    proc = subprocess.run([sys.executable, "-m", "wan_diloco.cli", "syncer", "--config", str(path), "--no-table"],
                          env=child_env(TOKEN), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("wan-diloco syncer: start barrier:") and "never joined: learner-0, learner-1" in line


def test_the_syncer_announces_joins_and_the_start_and_fails_once_the_timeout_passed(tmp_path):
    cfg = rt.load(barrier_config(tmp_path, need=2, timeout_s=30.0))
    service = SyncerService(cfg, TransportMetrics())
    clock = [1000.0]
    service.now = lambda: clock[0]

    def metadata(m):
        return serde.to_frame(Metadata(learner=m, step=0, c_steps=(0, 0), c_tokens=(0, 0),
                                       clock=VectorClock({f"learner-{m}": 1})))

    async def main():
        service.tick()
        box = service.hub.mailbox("learner-0")  # learner 0's update stream is open
        await service.on_metadata(metadata(0))
        assert service.status()["barrier"] == {"need": 2, "joined": [0], "waiting_for": [1], "started": False}
        said = [serde.control_from_frame(p.message) for p in box._pending.values()]
        assert said and isinstance(said[-1], serde.Barrier) and not said[-1].started
        clock[0] += 31.0
        service.tick()
        assert service.failed is not None and "never joined: learner-1" in service.failed
        assert service.finished.is_set()

    asyncio.run(main())

    fresh = SyncerService(cfg, TransportMetrics())

    async def met():
        await fresh.on_metadata(metadata(1))
        await fresh.on_metadata(metadata(0))
        assert fresh.barrier.started and fresh.status()["barrier"]["waiting_for"] == []
        fresh.tick()
        assert fresh.failed is None

    asyncio.run(met())


def _waiting_learner(says, timeout_s):
    """A Learner reduced to its barrier wait: ``says`` is what each drain hears from the syncer."""
    lrn = object.__new__(Learner)
    lrn.m, lrn.stop, lrn.barrier = 0, threading.Event(), BarrierView(timeout_s)
    lrn.cfg = types.SimpleNamespace(syncer=types.SimpleNamespace(liveness_timeout_s=0.3))
    lrn.core = types.SimpleNamespace(metadata=lambda: "metadata")
    lrn.sent = []
    lrn.send_metadata = lrn.sent.append

    def drain(block_s=0.0):
        time.sleep(block_s)
        lrn.barrier.on_status(*says(time.monotonic()))

    lrn.drain = drain
    return lrn


def test_a_learner_left_waiting_stops_with_one_line_and_one_met_in_time_goes_on(capsys):
    lrn = _waiting_learner(lambda now: (False, 2, (0,), (1,)), timeout_s=0.5)
    with pytest.raises(StartTimeout, match="never joined: learner-1") as e:
        lrn._await_start()
    assert "\n" not in str(e.value) and lrn.sent  # it kept saying it lives while it waited
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert said[0]["event"] == "barrier" and said[0]["waiting_for"] == [1] and not said[0]["started"]

    t0 = time.monotonic()
    lrn = _waiting_learner(lambda now: (now - t0 > 0.3, 2, (0, 1) if now - t0 > 0.3 else (0,),
                                        () if now - t0 > 0.3 else (1,)), timeout_s=30)
    lrn._await_start()  # returns once the syncer says started
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["started"] for e in said] == [False, True]
