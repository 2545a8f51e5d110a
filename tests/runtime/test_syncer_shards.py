"""Syncer shards with real processes on loopback (#15): a run with 2 shards ends with every copy bit-identical
and one parameter file; a shard killed mid-run resumes from its own snapshot while the other keeps merging."""
import json

import numpy as np
import pytest

from wan_diloco import shards
from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import SnapshotStore, read_params
from wan_diloco.runtime.launch import Cluster, launch

from .conftest import micro_config
from .helpers import status, wait_for
from .test_resume import event, finished


def sharded(tmp_path, steps, learners=2, snapshots=False):
    extra = f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\nevery_merges = 2\nkeep = 2\n' if snapshots else ""
    path = micro_config(tmp_path, learners=learners, steps=steps, min_step_s=0.05, extra=extra)
    path.write_text(path.read_text().replace("[run]\n", '[run]\nrun_id = "shard-test"\n', 1)
                    .replace("[syncer]\n", "[syncer]\nshards = 2\n", 1))
    return path


@pytest.mark.slow  # a whole launch, about 70 s; the kill-and-resume test below also ends bit-identical
def test_a_run_with_two_shards_ends_bit_identical_with_one_parameter_file(tmp_path):
    path = sharded(tmp_path, steps=40)
    cfg = rt.load(path)
    assert cfg.syncer.shards == 2
    code, summary = launch(cfg, path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reports = {e["source"]: e for e in events if e["source"].startswith("syncer") and e["event"] == "final"}
    listening = {e["source"]: e for e in events if e["source"].startswith("syncer") and e["event"] == "listening"}
    assert sorted(reports) == ["syncer", "syncer-1"]
    plan = shards.owners(Assembly(cfg).layout.nbytes, 2)
    for name, s in (("syncer", 0), ("syncer-1", 1)):  # each shard merged its own fragments only
        assert listening[name]["owned"] == shards.owned(plan, s)
        mine = set(listening[name]["owned"])
        assert all((d is None) == (p not in mine) for p, d in enumerate(reports[name]["digests"]))
        assert all(n >= 1 for p, n in enumerate(reports[name]["fragment_syncs"]) if p in mine)
    finals = [e for e in events if e["source"].startswith("learner") and e["event"] == "final"]
    assert len(finals) == 2 and summary["bit_identical"]
    joined = [a or b for a, b in zip(reports["syncer"]["digests"], reports["syncer-1"]["digests"])]
    assert all(f["digests"] == joined for f in finals)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    params, info = read_params(summary["params_path"])
    assert info["digests"] == joined and set(params) == set(Assembly(cfg).flat0)
    assert all(np.all(np.isfinite(a)) for a in params.values())


# A 400-step run of two shards and two learners (over 20 s). Its protocol (the killed shard resumes from its own
# snapshot at epoch 2 while shard 0 merges on at epoch 1; the learners rejoin told another shard than 0 resumed,
# so no snapshot of shard 1 is taken for theirs; every copy ends the syncer's) is replayed in seconds by
# tests/sim/test_faults.py; the status page's row of an unreachable shard by test_shard_status.py.
@pytest.mark.slow
def test_a_killed_shard_resumes_alone_while_the_other_keeps_merging(tmp_path):
    path = sharded(tmp_path, steps=400, snapshots=True)
    cfg = rt.load(path)
    plan = shards.owners(Assembly(cfg).layout.nbytes, 2)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncers()
        shard0, shard1 = cluster.children["syncer"], cluster.children["syncer-1"]
        learners = [cluster.start_learner(m) for m in range(2)]
        wait_for("a snapshot of shard 1", lambda: event(shard1, "snapshot"), timeout_s=120)
        page = status(cluster)
        assert [(r["shard"], r["reachable"], r["owned"]) for r in page["shards"]] == [
            (s, True, shards.owned(plan, s)) for s in (0, 1)]
        assert all(page["versions"][p] >= 1 for p in shards.owned(plan, 1))  # shard 1's versions, on shard 0's page
        cluster.kill("syncer-1")
        down = status(cluster)["shards"][1]
        assert not down["reachable"] and down["error"]
        theirs = SnapshotStore(tmp_path / "ckpt" / "shard-1").newest("syncer", "syncer")
        assert theirs is not None and theirs[2]["owned"] == shards.owned(plan, 1)

        def shard0_versions():
            return [e["versions"] for e in shard0.events if e.get("event") == "progress"]
        before = shard0_versions()[-1]
        # While shard 1 is down, shard 0's fragments keep merging.
        wait_for("shard 0 merging alone", lambda: any(
            v[p] > before[p] for v in shard0_versions()[-1:] for p in shards.owned(plan, 0)), timeout_s=60)
        resumed = cluster.start_syncer(resume=True, shard=1)
        hello = event(resumed, "listening")
        assert hello["epoch"] == 2 and hello["resumed"]["snapshot"] == theirs[0]
        assert SnapshotStore(tmp_path / "ckpt" / "shard-1").incarnation_seen() == 2  # a next resume goes to 3
        finished(cluster, timeout_s=240)
        assert {n: c.exit_code for n, c in cluster.children.items()} == {
            "syncer": 0, "syncer-1": 0, "learner-0": 0, "learner-1": 0}
        assert event(shard0, "listening")["epoch"] == 1  # shard 0 never restarted
        finals = [event(c, "final") for c in learners]
        a, b = event(shard0, "final")["digests"], event(resumed, "final")["digests"]
        assert all(f["digests"] == [x or y for x, y in zip(a, b)] and not f["digest_mismatch"] for f in finals)
        # They took up the resumed shard, told that shard 0 (their parts) lost nothing: no shard 1 snapshot id.
        assert all("shard other than 0 resumed" in event(c, "rejoin")["why"] for c in learners)
        # And fetched shard 1's fragments only, keeping their copies of shard 0's (runtime.learner_join).
        joins = [[(e["epoch"], e["fetched"]) for e in c.events if e.get("event") == "join"] for c in learners]
        assert all(j[0] == (1, list(range(len(plan)))) and (2, shards.owned(plan, 1)) in j[1:] for j in joins), joins
