"""Refusals as an operator sees them (#23): refused_total{field} on /metrics, /status["refused"], learner
states; a poisoned clock entry leaves merges going; one Metadata of step = run.steps against a real run
ends nothing early."""
import asyncio
import dataclasses
import json

import numpy as np
import pytest
from prometheus_client import generate_latest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import FragmentUpload, Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.launch import Cluster
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import Rejected, SyncerClient, TransportError, TransportMetrics, run

from .conftest import micro_config
from .helpers import status, wait_for


def sample(text: str, name: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).rsplit(" ", 1)[1])


def md(m, step, clock=None):
    return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                   clock=VectorClock(clock if clock is not None else {f"learner-{m}": step})))


def test_refusals_show_on_metrics_and_status_and_a_poisoned_clock_leaves_merges_going(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=4, steps=300))
    metrics = TransportMetrics()
    service = SyncerService(cfg, metrics)
    clock = [100.0]
    service.now = lambda: clock[0]

    def up(due, clock_entries):
        zeros = {n: np.zeros(service.layout.shapes[n], np.float32) for n in service.layout.fragments[0]}
        enc = service.codec.roundtrip(zeros)
        return serde.to_frame(FragmentUpload(
            learner=0, fragment=0, due_step=due, base_version=service.core.version[0], c_steps=8, c_tokens=1024,
            clock=VectorClock(clock_entries), delta=enc.values, nbytes=enc.nbytes, payload=enc.payload))

    async def main():
        for step in range(1, 9):
            clock[0] += 0.05
            await service.on_metadata(md(0, step))
        with pytest.raises(Rejected, match="past what its pace allows"):
            await service.on_metadata(md(1, cfg.run.steps, {"learner-1": 1}))  # case 1, as a learner never seen
        # Case 4: on main this entry froze every merge for good, and nothing was logged.
        with pytest.raises(Rejected, match="past what the syncer issued"):
            await service.on_fragment(up(8, {"learner-0": 9, "syncer": 2**53}))
        with pytest.raises(Rejected, match="Metadata.fragment"):  # one that does not decode: counted too
            await service.on_metadata(dataclasses.replace(md(0, 9), fragment=1))
        await service.on_fragment(up(8, {"learner-0": 9}))
        clock[0] += 0.05
        await service.on_metadata(md(0, 9, {"learner-0": 10, "syncer": 1}))
        await service.on_fragment(up(16, {"learner-0": 11, "syncer": 1}))
        service.refresh_gauges()
        return generate_latest(metrics.registry).decode()

    text = run(asyncio.wait_for(main(), 30))
    assert service.core.version[0] == 2 and service.core.global_step == 9  # merges go on
    assert sample(text, 'wan_diloco_refused_total{field="metadata.step"}') == 1
    assert sample(text, 'wan_diloco_refused_total{field="clock"}') == 1
    assert sample(text, 'wan_diloco_refused_total{field="metadata.fragment"}') == 1
    status = service.status()
    assert status["refused"] == {"metadata.step": 1, "clock": 1, "metadata.fragment": 1}
    assert service.core.refusals.by_learner == {1: 1, 0: 2}  # each against the sender's credential
    # Case 10: 4 learners configured, one ever connected: only it is alive, the others are waiting.
    assert status["alive"] == [0]
    assert [status["learners"][str(m)]["state"] for m in range(4)] == ["alive", "waiting", "waiting", "waiting"]
    warnings = [e["what"] for e in status["events"] if e["kind"] == "warning"]
    assert any("learner 1 [metadata.step]" in w for w in warnings) and any("learner 0 [clock]" in w for w in warnings)
    json.dumps(status)


# ---- a real run ---------------------------------------------------------------------------------


# Its logic runs at core speed in tests/core/test_refused_last_step.py (and test_plausibility.py); the refusal
# over the wire is this file's first test; a real run ending bit-identical is tests/runtime/test_end_to_end.py.
@pytest.mark.slow  # a real 300-step run of 2 learners: minutes under load
def test_one_metadata_at_the_last_step_does_not_end_a_real_run(tmp_path):
    # Case 1 as observed: a token holder sends one Metadata as learner 1 with step = run.steps while the
    # learners are early in the run. On main the syncer took it as the global step, the learners jumped
    # there, ran the final sync and exited 0 at a fraction of the budget.
    steps = 300
    path = micro_config(tmp_path, learners=2, steps=steps, min_step_s=0.02)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncer()
        learners = [cluster.start_learner(m) for m in range(2)]
        wait_for("the learners to train", lambda: 20 <= status(cluster)["global_step"], timeout_s=120)

        async def rogue():
            async with SyncerClient(cluster.syncer_target, cluster.token, cfg.transport) as client:
                with pytest.raises(TransportError, match="past what its pace allows"):
                    await client.send_metadata(serde.to_frame(Metadata(
                        learner=1, step=steps, c_steps=(0, 0), c_tokens=(0, 0), clock=VectorClock({"learner-1": 1}))))

        run(asyncio.wait_for(rogue(), 30))
        st = status(cluster)
        assert st["global_step"] < steps // 2 and st["refused"] == {"metadata.step": 1}
        wait_for("the end of the run", lambda: all(c.exit_code is not None for c in cluster.children.values()),
                 timeout_s=240)
        assert all(c.exit_code == 0 for c in cluster.children.values())
        syncer = next(e for e in cluster.children["syncer"].events if e.get("event") == "final")
        finals = [next(e for e in c.events if e.get("event") == "final") for c in learners]
        assert all(f["digests"] == syncer["digests"] for f in finals)
        # The run went to its budget: the learner ahead trained (nearly) every step itself.
        batch_tokens = cfg.run.batch_size * cfg.model.seq_len
        assert max(f["tokens"] for f in finals) >= 0.9 * steps * batch_tokens
        assert syncer["global_step"] >= steps
