"""Snapshots and resume with real processes on loopback (#13): a syncer killed mid-run comes back from
its newest complete snapshot and the running learners rejoin it; a syncer restarted without one stops
the learners instead of mixing models; `launch --resume` restarts a whole run from its snapshot."""
import asyncio
import json

import numpy as np
import pytest

from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import SnapshotStore, read_params
from wan_diloco.runtime.launch import Cluster, launch, run_spec, write_config
from wan_diloco.runtime.syncer import ResumeError, SyncerService
from wan_diloco.transport import TransportMetrics

from .conftest import TOKEN, micro_config
from .helpers import wait_for


def config(tmp_path, steps=400):
    extra = f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\nevery_merges = 2\nkeep = 2\n'
    return micro_config(tmp_path, learners=2, steps=steps, min_step_s=0.05, extra=extra)


def event(child, kind):
    return next((e for e in child.events if e.get("event") == kind), None)


def finished(cluster, timeout_s=120):
    wait_for("the end of the run", lambda: all(c.exit_code is not None for c in cluster.children.values()),
             timeout_s=timeout_s)


# ~85 s of real processes. The protocol (resume from the newest complete snapshot at the next epoch, the
# running learners rejoin) is replayed by tests/sim/test_faults.py; the resume from files on disk stays in
# the default run below, and a real stop and resume in test_stop_resume.py and `bench.chaos --quick`.
@pytest.mark.slow
def test_a_killed_syncer_resumes_from_its_snapshot_and_the_running_learners_rejoin(tmp_path):
    path = config(tmp_path)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        syncer = cluster.start_syncer()
        learners = [cluster.start_learner(m) for m in range(2)]
        # A learner that has not trained yet (it may start late) is not part of a cut: wait for one of both.
        wait_for("a complete snapshot of both learners", lambda: next(
            (e for e in syncer.events if e.get("event") == "snapshot" and len(e["parts"]) == 3), None), timeout_s=120)
        cluster.kill("syncer")
        store = SnapshotStore(tmp_path / "ckpt")
        snap, tensors, info, manifest = store.newest("syncer", "syncer")
        assert set(manifest["parts"]) == {"syncer", "learner-0", "learner-1"}
        resumed = cluster.start_syncer(resume=True)
        listening = event(resumed, "listening")
        assert listening["resumed"]["snapshot"] == snap and listening["epoch"] == 2
        assert listening["run_id"] == info["run_id"] == manifest["run_id"]
        finished(cluster)
        assert [c.exit_code for c in cluster.children.values()] == [0, 0, 0]
        final = event(resumed, "final")
        for child in learners:
            assert event(child, "rejoin") is not None  # the running learner took up the resumed syncer
            mine = event(child, "final")
            assert mine["digests"] == final["digests"] and mine["epoch"] == 2 and not mine["digest_mismatch"]
    # The final parameters are a file, loadable without the run.
    params, pinfo = read_params(tmp_path / "ckpt" / "params.safetensors")
    assert pinfo["digests"] == final["digests"] and pinfo["run_id"] == info["run_id"]
    assert all(np.all(np.isfinite(a)) for a in params.values())


def test_resume_restores_the_snapshots_global_state_and_skips_a_corrupt_one(tmp_path):
    # Three snapshots cut, written and collected by the syncer's own IO in process (no learner process: the
    # resume from files on disk is what this checks; a real run's snapshots are resumed by the slow tests here,
    # test_stop_resume.py and `bench.chaos --quick`, their protocol by tests/sim/test_faults.py).
    cfg = rt.load(config(tmp_path))
    service = SyncerService(cfg, TransportMetrics())

    async def three_snapshots():
        for _ in range(3):
            snap = service.snapshot_now()
            while snap not in service.snapshots.complete:
                await asyncio.sleep(0.01)

    asyncio.run(three_snapshots())
    store = SnapshotStore(tmp_path / "ckpt")
    complete = store.complete_ids()
    assert len(complete) == 2  # keep = 2: older ones were deleted
    # The newest snapshot with a syncer part and learner parts (one cut late in the run may lack its manifest).
    snap, tensors, info, _ = store.resumable("syncer", "syncer", 2)
    assert snap >= complete[-1]
    older = [s for s in store.ids() if s < snap and store.part(s, "syncer").exists()][-1]
    store.skipped.clear()
    service = SyncerService(cfg, TransportMetrics(), resume=True)
    core = service.core
    assert service.resumed["snapshot"] == snap and core.epoch == info["epoch"] + 1 and core.resumed_from == snap
    assert core.version == info["versions"] and core.global_step == info["global_step"]
    for p, frag in enumerate(core.theta):
        assert all(np.array_equal(a, tensors[f"theta/{p}/{n}"]) for n, a in frag.items())
    # Damage the newest snapshot's syncer part: the one before it is used, and it says so.
    part = store.part(snap, "syncer")
    part.write_bytes(part.read_bytes()[:-7])
    service = SyncerService(cfg, TransportMetrics(), resume=True)
    assert service.resumed["snapshot"] == older and service.resumed["skipped"][0][0] == snap
    for s in store.ids():
        store.part(s, "syncer").unlink(missing_ok=True)
    with pytest.raises(ResumeError, match="no snapshot to resume from.*snapshot"):
        SyncerService(cfg, TransportMetrics(), resume=True)


def snapshotted(tmp_path):
    """A run's config and parts with one complete snapshot cut from a fresh syncer (no training)."""
    cfg = rt.load(config(tmp_path))
    parts = Assembly(cfg)
    fresh = SyncerService(cfg, TransportMetrics(), parts)
    w, _ = fresh.snapshots.cut(0.0, 0.0)  # and its announcement to the learners
    fresh.store.save_part(w.snapshot, "syncer", w.tensors, w.info, "syncer")
    fresh.store.mark_complete(w.snapshot, {"parts": ["syncer"], "run_id": fresh.core.run_id, "epoch": 1})
    return cfg, parts


def test_each_resume_records_its_incarnation_so_the_next_goes_past_it(tmp_path):
    # No training: the snapshot is cut from a fresh syncer. Two resumes from it, with no snapshot complete in
    # between, must not share an incarnation (learners would take the dead one's messages for current).
    cfg, parts = snapshotted(tmp_path)
    epochs = [SyncerService(cfg, TransportMetrics(), parts, resume=True).core.epoch for _ in range(2)]
    assert epochs == [2, 3] and SnapshotStore(tmp_path / "ckpt").incarnation_seen() == 3
    (tmp_path / "ckpt" / "INCARNATION.json").write_text("{")
    with pytest.raises(ResumeError, match="INCARNATION.json: unreadable.*highest incarnation"):
        SyncerService(cfg, TransportMetrics(), parts, resume=True)


def test_a_resume_on_a_full_disk_retries_recording_its_incarnation_then_fails_naming_why(tmp_path, monkeypatch):
    # A disk-full window during a restart (bench.chaos --quick under load) must not lose the run at once:
    # the record is retried as the final parameters are, and the resume fails only past that budget.
    import dataclasses
    import errno

    cfg, parts = snapshotted(tmp_path)
    real, fails = SnapshotStore.record_incarnation, [2]

    def full_disk(store, epoch, run_id):
        if fails[0]:
            fails[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(store, epoch, run_id)

    monkeypatch.setattr(SnapshotStore, "record_incarnation", full_disk)
    assert SyncerService(cfg, TransportMetrics(), parts, resume=True).core.epoch == 2 and fails == [0]
    assert SnapshotStore(tmp_path / "ckpt").incarnation_seen() == 2
    fails[0] = 10**6
    no_retry = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, final_write_retry_s=0))
    with pytest.raises(ResumeError, match="could not record incarnation 3.*final_write_retry_s.*No space left"):
        SyncerService(no_retry, TransportMetrics(), parts, resume=True)
    assert SnapshotStore(tmp_path / "ckpt").incarnation_seen() == 2


@pytest.mark.slow  # ~45 s; the core's IncarnationError tests cover the decision
def test_a_syncer_restarted_from_scratch_stops_the_learners_instead_of_mixing_models(tmp_path):
    """#23 case 3: with run.run_id set (as launch always does) a fresh syncer has the run's id and
    incarnation 1. Over the run's checkpoint.dir it refuses to start; over another folder (say on another
    host) the learners see a new process with no snapshot and stop rather than feed it."""
    path = config(tmp_path)
    # A run id as launch writes one; the learners wait out two syncer start-ups on a loaded machine.
    path.write_text(path.read_text().replace("[run]\n", '[run]\nrun_id = "run-fixed"\n', 1)
                    .replace("retry_budget_s = 15.0", "retry_budget_s = 90.0"))
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        syncer = cluster.start_syncer()
        learners = [cluster.start_learner(m) for m in range(2)]
        wait_for("merges", lambda: any(e.get("event") == "progress" and sum(e["versions"]) >= 4 for e in syncer.events),
                 timeout_s=120)
        wait_for("a snapshot", lambda: event(syncer, "snapshot") is not None, timeout_s=60)
        cluster.kill("syncer")
        with pytest.raises(RuntimeError, match="refusing to start.*--resume"):
            cluster.start_syncer()  # same port, same folder, no --resume
        elsewhere = tmp_path / "elsewhere.toml"
        elsewhere.write_text(path.read_text().replace(str(tmp_path / "ckpt"), str(tmp_path / "ckpt2")))
        cluster.config_path = elsewhere
        cluster.start_syncer()  # a fresh model at version 0, the same run id and incarnation
        wait_for("the learners to stop", lambda: all(c.exit_code is not None for c in learners), timeout_s=90)
        assert [c.exit_code for c in learners] == [3, 3]
        for child in learners:
            assert "restarted from scratch" in event(child, "error")["error"]
        cluster.stop_all()


@pytest.mark.slow  # ~75 s; the by-hand resume above runs by default
def test_launch_resume_restarts_a_stopped_run_from_its_snapshot(tmp_path):
    rdir = tmp_path / "run"
    rdir.mkdir()
    cfg = run_spec(rt.load(config(tmp_path)), rdir)
    write_config(rdir / "config.toml", cfg)
    assert (rdir / "config.toml").stat().st_mode & 0o777 == 0o600 and TOKEN not in (rdir / "config.toml").read_text()
    with Cluster(cfg, rdir / "config.toml", rdir) as cluster:
        syncer = cluster.start_syncer()
        for m in range(2):
            cluster.start_learner(m)
        wait_for("a complete snapshot", lambda: event(syncer, "snapshot"), timeout_s=120)
    snap = SnapshotStore(tmp_path / "ckpt").complete_ids()[-1]
    code, summary = launch(rt.load(rdir / "config.toml"), "", str(rdir), resume=True)
    assert code == 0, summary
    assert summary["bit_identical"] and summary["learners_finished"] == 2 and summary["syncer_epoch"] >= 2
    events = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert sorted(e["learner"] for e in resumed) == [0, 1] and all(e["snapshot"] >= snap for e in resumed)


@pytest.mark.slow  # ~50 s
def test_learners_left_without_a_syncer_stop_with_one_line_after_the_retry_budget(tmp_path):
    path = config(tmp_path, steps=4000)  # transport.retry_budget_s = 15 s, long before the last step
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncer()
        learner = cluster.start_learner(0)
        wait_for("training", lambda: any(e.get("event") == "step" for e in learner.events), timeout_s=120)
        cluster.kill("syncer")
        wait_for("the learner to give up", lambda: learner.exit_code is not None, timeout_s=90)
        assert learner.exit_code == 3
        error = event(learner, "error")["error"]
        assert "syncer" in error and "\n" not in error
        lines = (tmp_path / "run" / "learner-0.log").read_text().strip().splitlines()
        assert lines[-1].startswith("learner-0: stopping:") and "Traceback" not in "".join(lines)


@pytest.mark.slow  # ~60 s
def test_learners_in_their_final_sync_rejoin_a_resumed_syncer_and_sync_again(tmp_path):
    path = config(tmp_path, steps=200)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        syncer = cluster.start_syncer()
        learners = [cluster.start_learner(m) for m in range(2)]
        wait_for("a complete snapshot", lambda: event(syncer, "snapshot"), timeout_s=120)
        # Two seconds of steps before the end: a restarted syncer (import, warm-up) takes longer, so both
        # learners reach their final sync while it is down and upload their finals to the dead incarnation.
        wait_for("the last steps", lambda: any(e.get("event") == "step" and e["step"] >= cfg.run.steps - 40
                                              for e in learners[0].events), timeout_s=120)
        cluster.kill("syncer")
        resumed = cluster.start_syncer(resume=True)
        finished(cluster)
        assert [c.exit_code for c in cluster.children.values()] == [0, 0, 0]
        final, listening = event(resumed, "final"), event(resumed, "listening")
        for child in learners:
            assert event(child, "finishing")["t"] < listening["t"]  # in its final sync when it came back
            mine = event(child, "final")
            assert mine["epoch"] == 2 and mine["rejoins"] >= 1
            assert mine["digests"] == final["digests"] and not mine["digest_mismatch"]
