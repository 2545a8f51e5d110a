"""SIGKILL a learner mid-run: the others keep stepping, the syncer keeps merging (K = 1); restarted, it
rejoins from the syncer's global parameters and a healthy peer's state, contributes again, and ends
bit-identical."""

import pytest

from wan_diloco import spec as rt
from wan_diloco.runtime.launch import Cluster

from .conftest import micro_config
from .helpers import status, wait_for


def last_tokens(child):
    tokens = [e["tokens"] for e in child.events if e.get("event") == "step"]
    return tokens[-1] if tokens else 0


def last_step(child):
    steps = [e["step"] for e in child.events if e.get("event") == "step"]
    return steps[-1] if steps else 0


# ~70 s of real processes. The protocol it checks (a learner recovered from a peer with the peer's optimizer,
# then contributing) is replayed by tests/sim/test_donations.py and test_faults.py in seconds with the same core
# code on both sides (Donations, Donor, donation parts); the donation and data-position wire paths stay in the
# default run in test_recovery_service.py.
@pytest.mark.slow
def test_killed_learner_rejoins_and_contributes_again(tmp_path):
    # Long enough for a restart under load; τ = 2 gives a grace window longer than a step, so the
    # rejoined learner is merged whatever its phase relative to the others (with τ = 1 a learner
    # lagging by more than the grace is dropped as late every round: K = 1 without enough grace).
    path = micro_config(tmp_path, learners=3, steps=600, min_step_s=0.05, tau=2)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncer()
        learners = [cluster.start_learner(m) for m in range(3)]
        # Its own steps (it may join late, at the others' step): five batches of its stream at least.
        batch_tokens = cfg.run.batch_size * cfg.model.seq_len
        trained_before_kill = wait_for("learner 2 to train", lambda: (n := last_tokens(learners[2])) >= 5 * batch_tokens and n)
        cluster.kill("learner-2")
        st = wait_for("the syncer to notice", lambda: (s := status(cluster))["learners"]["2"]["alive"] is False and s)
        versions_at_kill, steps_at_kill = sum(st["versions"]), [last_step(c) for c in learners[:2]]
        # The others keep stepping and the syncer keeps merging without learner 2.
        st = wait_for("merges without learner 2", lambda: sum((s := status(cluster))["versions"]) >= versions_at_kill + 2 and s)
        # Rounds that waited for learner 2 close the moment it is lost, before the others report a step.
        wait_for("the others to keep stepping", lambda: all(last_step(c) > n for c, n in zip(learners[:2], steps_at_kill)),
                 timeout_s=20)
        restarted_s = st["uptime_s"]
        assert 2 not in {m for h in st["history"] if h["closed_s"] > restarted_s for m in h["contributors"]}
        rejoined = cluster.start_learner(2)
        start = wait_for("the rejoin", lambda: next((e for e in rejoined.events if e.get("event") == "start"), None))
        assert start["step"] > 0  # took up the global step from the syncer instead of starting at 0
        assert start["schedule_step"] >= start["step"]  # and the learning-rate schedule with it
        # Its data stream goes on from where its metadata last left it, not from the seed's first windows.
        # Metadata goes out after each step, asynchronously: the kill can land before the last one reaches
        # the syncer, so the position it keeps may lag the last step event by one batch.
        position = next(e for e in rejoined.events if e.get("event") == "data_position")
        assert position["restored"] and position["batches"] >= trained_before_kill // batch_tokens >= 5  # a fresh stream: 1
        # Peer recovery: a healthy learner gave it parameters, inner optimizer and residuals (#13).
        recovered = next(e for e in rejoined.events if e.get("event") == "recovered")
        assert recovered["from_peer"] and recovered["donor"] in (0, 1) and recovered["bytes"] > 0
        donated = wait_for("the donor's report", lambda: next(
            (e for e in learners[recovered["donor"]].events if e.get("event") == "donated" and e["recipient"] == 2),
            None))
        # Its inner optimizer is the donor's, bit for bit, as it arrived; then only the learning-rate schedule
        # position moves to the global step it joined at (under load the donor's own count can lag it).
        assert donated["opt_digest"] == recovered["opt_digest"]
        assert recovered["schedule_step"] >= recovered["step"]
        wait_for("a merge with learner 2 after its restart", lambda: any(
            2 in h["contributors"] and h["closed_s"] > restarted_s for h in status(cluster)["history"]))
        wait_for("the end of the run", lambda: all(c.exit_code is not None for c in cluster.children.values()),
                 timeout_s=90)
        assert cluster.children["syncer"].exit_code == 0 and rejoined.exit_code == 0
        syncer = next(e for e in cluster.children["syncer"].events if e.get("event") == "final")
        for child in (learners[0], learners[1], rejoined):
            final = next(e for e in child.events if e.get("event") == "final")
            assert final["digests"] == syncer["digests"]
