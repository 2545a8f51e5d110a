"""The syncer's snapshot coordinator: cut, parts written, completion, resume as the next epoch, fork refusal."""
import numpy as np
import pytest

from wan_diloco.core import LearnerConfig, LearnerCore, SaveState, SyncerConfig, SyncerCore
from wan_diloco.core.barrier import StartBarrier
from wan_diloco.core.positions import Positions
from wan_diloco.core.messages import SnapshotCut
from wan_diloco.core.snapshots import (
    AnnounceSnapshot, Found, ResumeError, SnapshotComplete, SnapshotCoordinator, WriteManifest, WriteSyncerPart, fork_refusal,
)

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, meta, upload


def make(every=2, learner_parts=True, first_id=1):
    core = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    core.start("run-a")
    barrier, positions = StartBarrier(1, 2, 60.0), Positions(2)
    coord = SnapshotCoordinator(core, barrier, positions, every_merges=every, patience_s=10.0, learners=2,
                                learner_parts=learner_parts, first_id=first_id)
    return core, barrier, positions, coord


def test_a_cut_every_n_merges_writes_the_syncer_part_with_what_a_resume_needs():
    core, barrier, positions, coord = make(every=2, first_id=5)
    for m in (0, 1):
        core.on_metadata(0.0, meta(m, step=4))
    barrier.on_metadata(0.0, 0)
    positions.on_metadata(0.0, 1, '{"batches":3}')
    core.on_fragment(0.0, upload(0, fragment=0, due=8))
    assert coord.on_merged(0.5, 1000.0) == []  # one merge: not due yet
    core.on_fragment(1.0, upload(0, fragment=1, due=8))
    [w, announce] = coord.on_merged(1.0, 1000.0)
    assert isinstance(w, WriteSyncerPart) and w.snapshot == 5 == core.snapshot_id
    assert announce == AnnounceSnapshot(SnapshotCut(5, core.epoch)) == AnnounceSnapshot(coord.announcement())
    assert w.info["cut_unix_s"] == 1000.0 and w.info["barrier_started"] is True
    assert w.info["positions"] == {"1": '{"batches":3}'} and w.info["versions"] == [1, 1]
    assert coord.pending[5].learners == {0, 1} and not coord.pending[5].syncer
    assert coord.on_merged(1.5, 1000.0) == []  # no new merges since the cut
    assert coord.cut(2.0, 1001.0)[0].snapshot == 6  # ids only grow


def test_complete_once_the_syncer_part_and_every_live_learner_part_are_written():
    core, _, _, coord = make()
    for m in (0, 1):
        core.on_metadata(0.0, meta(m, step=4))
    w, _ = coord.cut(0.0, 0.0)
    assert coord.on_metadata(1.0, 0, w.snapshot, epoch=core.epoch) == []  # the syncer's part is not written yet
    assert coord.on_part_written(1.0, w.snapshot, ok=True, nbytes=123) == []  # learner 1's is missing
    assert coord.on_metadata(1.0, 1, w.snapshot, epoch=core.epoch + 1) == []  # another incarnation's part
    [mf] = coord.on_metadata(2.0, 1, w.snapshot, epoch=core.epoch)
    assert isinstance(mf, WriteManifest) and mf.manifest["parts"] == ["syncer", "learner-0", "learner-1"]
    assert mf.manifest["run_id"] == "run-a" and mf.manifest["learners"] == 2
    [done] = coord.on_manifest_written(2.0, w.snapshot, ok=True)
    assert done == SnapshotComplete(w.snapshot, ("syncer", "learner-0", "learner-1"), 123, 2.0)
    assert coord.last_complete == w.snapshot and not coord.pending


def test_a_dead_or_silent_learner_is_not_waited_for_and_a_failed_write_gives_the_snapshot_up():
    core, _, _, coord = make()
    for m in (0, 1):
        core.on_metadata(0.0, meta(m, step=4))
    w, _ = coord.cut(0.0, 0.0)
    coord.on_part_written(0.1, w.snapshot, ok=True)
    core.on_peer_lost(1.0, 1)
    [mf] = coord.on_metadata(1.0, 0, w.snapshot, epoch=core.epoch)
    assert mf.manifest["parts"] == ["syncer", "learner-0"]
    assert coord.on_manifest_written(1.0, w.snapshot, ok=False) == [] and coord.complete == []
    w2, _ = coord.cut(2.0, 0.0)
    assert coord.check(5.0) == []
    coord.on_part_written(5.0, w2.snapshot, ok=True)
    assert [type(a) for a in coord.check(12.5)] == [WriteManifest]  # silent past patience_s: not waited for
    w3, _ = coord.cut(13.0, 0.0)
    assert coord.on_part_written(13.0, w3.snapshot, ok=False) == [] and w3.snapshot not in coord.pending


def test_a_cut_announced_to_the_learners_completes_once_each_wrote_its_part_on_it():
    core, _, _, coord = make()
    learners = [LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1), m, FRAGS, PARAMS, CODEC)
                for m in (0, 1)]
    for lc in learners:
        lc.join(core.run_id, core.epoch, 0, [(PARAMS, 0), (PARAMS, 0)], 0)
        core.on_metadata(0.0, meta(lc.learner, step=4))
    w, announce = coord.cut(0.0, 0.0)
    cut = announce.msg
    coord.on_part_written(0.1, w.snapshot, ok=True)
    done = []
    for lc in learners:
        assert lc.on_snapshot_cut(0.2, cut) == [SaveState(w.snapshot)]  # the driver writes the part, then:
        lc.saved(w.snapshot)
        done += coord.on_metadata(0.3, lc.learner, lc.metadata().snapshot, lc.metadata().epoch)
    assert [type(a) for a in done] == [WriteManifest] and done[0].manifest["parts"] == ["syncer", "learner-0",
                                                                                      "learner-1"]


def test_nothing_is_cut_at_the_end_of_the_run_nor_completed_while_stopping():
    core, _, _, coord = make()
    core.on_metadata(0.0, meta(0, step=4))
    w, _ = coord.cut(0.0, 0.0)
    coord.stop()
    assert coord.on_part_written(1.0, w.snapshot, ok=True) == []
    core.final_started = True
    assert coord.cut(2.0, 0.0) == []


def test_shards_other_than_zero_wait_for_no_learner_part():
    core, _, _, coord = make(learner_parts=False)
    core.on_metadata(0.0, meta(0, step=4))
    [w] = coord.cut(0.0, 0.0)  # and announce nothing: the learners' parts are in shard 0's snapshots
    assert coord.announcement() is None
    assert [type(a) for a in coord.on_part_written(0.1, w.snapshot, ok=True)] == [WriteManifest]


def test_resume_is_the_next_incarnation_with_the_barrier_and_positions_of_the_snapshot():
    core, barrier, positions, coord = make()
    core.on_metadata(0.0, meta(0, step=4))
    barrier.on_metadata(0.0, 0)
    positions.on_metadata(0.0, 0, "p0")
    core.on_fragment(0.0, upload(0, fragment=0, due=8))
    w, _ = coord.cut(0.0, 1000.0)
    theirs, b2, pos2, again = make()
    found = Found(w.snapshot, w.tensors, w.info, None, skipped=((9, "digest mismatch"),), missing=("learner-1",),
                  have=("learner-0",))
    got = again.resume(0.0, 1010.0, found, "/ckpt", "run-a", 30.0)
    assert theirs.epoch == 2 and theirs.resumed_from == theirs.snapshot_id == w.snapshot
    assert theirs.version == [1, 0] and np.array_equal(theirs.theta[0]["block_0/w"], core.theta[0]["block_0/w"])
    assert b2.started and pos2.of(0) == "p0" and got["complete"] is False and got["epoch"] == 2
    assert got["notes"] == ["snapshot 9 passed over: digest mismatch",
                            f"snapshot {w.snapshot} is incomplete: no part of learner-1; they recover from a peer "
                            f"(learner-0 resume their parts)"]
    assert again.announcement() is None  # it cut nothing yet: the learners hold their parts of the one it resumed
    assert again.cut(1.0, 0.0)[1] == AnnounceSnapshot(SnapshotCut(w.snapshot + 1, 2)) == AnnounceSnapshot(
        again.announcement())


def test_two_resumes_from_one_snapshot_are_two_incarnations():
    core, _, _, coord = make()
    w, _ = coord.cut(0.0, 0.0)  # cut in incarnation 1
    for seen, epoch in [(0, 2), (2, 3), (3, 4), (1, 2)]:  # the store's record, else the snapshot's epoch, + 1
        theirs, _, _, again = make()
        got = again.resume(0.0, 0.0, Found(w.snapshot, w.tensors, w.info, {}, epoch_seen=seen), "/ckpt", "", 30.0)
        assert theirs.epoch == got["epoch"] == epoch and theirs.resumed_from == w.snapshot


def test_resume_refuses_nothing_found_another_run_or_a_snapshot_that_does_not_fit():
    _, _, _, coord = make()
    with pytest.raises(ResumeError, match="in /ckpt: snapshot 3: unreadable"):
        coord.resume(0.0, 0.0, None, "/ckpt", "", 30.0, skipped=((3, "unreadable"),))
    core, _, _, other = make()
    w, _ = other.cut(0.0, 0.0)
    with pytest.raises(ResumeError, match="is of run 'run-a', the config says run.run_id = 'run-b'"):
        coord.resume(0.0, 0.0, Found(w.snapshot, w.tensors, w.info, {}), "/ckpt", "run-b", 30.0)
    bad = dict(w.info, fragments=[["x"]])
    with pytest.raises(ResumeError, match="does not fit this config"):
        coord.resume(0.0, 0.0, Found(w.snapshot, w.tensors, bad, {}), "/ckpt", "", 30.0)
    assert coord.core.epoch == 1  # nothing changed


def test_a_fresh_start_over_snapshots_is_refused_and_a_resume_is_not():
    assert fork_refusal(False, "x holds 2 snapshot(s)") == "x holds 2 snapshot(s)"
    assert fork_refusal(True, "x holds 2 snapshot(s)") is None and fork_refusal(False, None) is None
