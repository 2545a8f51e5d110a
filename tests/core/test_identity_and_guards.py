"""The cores' defences (#13): identity across syncer incarnations, sanity bounds, quarantine, watermarks,
snapshot export/restore."""
import dataclasses

import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.core import (
    ApplyGlobal, IncarnationError, LearnerConfig, LearnerCore, ProtocolError, Rejoin, SaveState,
    SyncerConfig, SyncerCore,
)
from wan_diloco.core.messages import SnapshotCut
from wan_diloco.outer import OuterConfig

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, meta, upload


def syncer(**kw):
    cfg = SyncerConfig(**{"num_learners": 3, "quorum": 1, "grace": False, **kw})
    return SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC)


def learner(m=0):
    return LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1), m, FRAGS, PARAMS, CODEC)


def joined(m=0, run_id="run-a", epoch=1):
    core = learner(m)
    core.join(run_id, epoch, 0, [(PARAMS, 0), (PARAMS, 0)], 0)
    return core


# ---- syncer: bounds and quarantine ------------------------------------------------------


def test_a_step_beyond_the_run_is_refused_and_changes_nothing():
    s = syncer(max_step=300)
    s.on_metadata(0.0, meta(0, step=8))
    with pytest.raises(ProtocolError, match="step 1000000000 beyond the run's 300 steps"):
        # a plausible clock: a step past the budget is refused for that alone
        s.on_metadata(0.1, dataclasses.replace(meta(1, step=10**9), clock=VectorClock({"learner-1": 1})))
    assert s.global_step == 8 and 1 not in s.learners
    with pytest.raises(ProtocolError, match="due step 400 beyond"):
        s.on_fragment(0.2, upload(1, due=400))


def test_a_clock_naming_unknown_nodes_is_refused():
    s = syncer()
    fat = dataclasses.replace(meta(0), clock=VectorClock({f"x{i}": 1 for i in range(25_000)}))
    with pytest.raises(ProtocolError, match="25000 unknown node"):
        s.on_metadata(0.0, fat)
    bad = dataclasses.replace(upload(0), clock=VectorClock({"learner-7": 1}))
    with pytest.raises(ProtocolError, match="'learner-7'"):
        s.on_fragment(0.0, bad)
    assert s.clock == VectorClock() and s.stats.bytes_in == 0


def test_an_absurd_outer_gradient_is_refused_and_its_learner_quarantined_while_the_run_goes_on():
    s = syncer(quarantine_s=60.0)
    theta = {n: a.copy() for n, a in s.theta[0].items()}
    with pytest.raises(ProtocolError, match="quarantined for 60 s"):
        s.on_fragment(1.0, upload(2, delta=np.full(3, 3.3e38, np.float32)))
    assert all(np.array_equal(theta[n], s.theta[0][n]) for n in theta) and s.version == [0, 0]
    assert s.stats.quarantines == 1 and 2 not in s.alive() and "learner 2 quarantined" in s.notices[-1]
    with pytest.raises(ProtocolError, match="learner 2 is quarantined for another 59 s"):
        s.on_metadata(2.0, meta(2))
    [b] = s.on_fragment(3.0, upload(0))  # the others go on
    assert b.msg.contributors == (0,)
    s.on_metadata(62.0, meta(2))  # served its time
    assert 2 in s.alive()


def test_a_merge_whose_outer_step_overflows_is_refused_and_theta_and_momentum_stay():
    # A huge but admissible Δ with the largest outer learning rate allowed: the step leaves float32.
    s = syncer(outer=OuterConfig(lr=10.0, momentum=0.5), max_delta_ratio=1e38)
    theta, momentum = dict(s.theta[0]), s.outer.states[0]
    assert s.on_fragment(1.0, upload(0, delta=np.full(3, 1e38, np.float32))) == []
    assert s.stats.refused_rounds == 1 and "refused" in s.notices[-1]
    assert all(np.array_equal(theta[n], s.theta[0][n]) for n in theta) and s.outer.states[0] is momentum
    assert s.version == [0, 0]


def test_a_finite_update_that_overflows_theta_is_refused_before_the_momentum_moves():
    # Θ near float32's largest value, a finite update of the same sign: only Θ + update leaves float32.
    big = {"block_0/w": np.full(3, 3e38, np.float32), "embed/embedding": PARAMS["embed/embedding"]}
    s = SyncerCore(SyncerConfig(num_learners=3, quorum=1, grace=False, max_delta_ratio=1e38,
                                outer=OuterConfig(lr=1.0, momentum=0.5)), FRAGS, big, is_embedding, CODEC)
    theta, trace = dict(s.theta[0]), {n: a.copy() for n, a in s.outer.states[0][0].trace.items()}
    assert s.on_fragment(1.0, upload(0, delta=np.full(3, -1e38, np.float32))) == []  # update = +1e38 (lr 1)
    assert s.stats.refused_rounds == 1 and "overflowed" in s.notices[-1]
    assert all(np.array_equal(theta[n], s.theta[0][n]) for n in theta)
    assert all(np.array_equal(trace[n], s.outer.states[0][0].trace[n]) for n in trace) and s.version == [0, 0]


def test_an_infinite_outer_lr_is_a_config_error():
    from wan_diloco.config import ConfigError

    with pytest.raises(ConfigError, match="lr"):
        OuterConfig(lr=float("inf")).validate()


def test_a_delta_sent_before_its_learner_saw_its_previous_merge_is_dropped_as_a_duplicate():
    s = syncer()
    [b] = s.on_fragment(1.0, upload(0, due=4, base_version=0))
    assert b.msg.to_version == 1 and s.merged_at[(0, 0)] == 1
    # The same base again (the learner has not seen version 1): its steps are in version 1 already.
    assert s.on_fragment(2.0, upload(0, due=8, base_version=0)) == []
    assert s.stats.duplicate_dropped == 1
    [b] = s.on_fragment(3.0, upload(0, due=12, base_version=1))
    assert b.msg.to_version == 2


# ---- identity ---------------------------------------------------------------------------


def test_updates_carry_the_run_and_the_incarnation_and_no_snapshot_announcement():
    s = syncer()
    s.run_id, s.epoch, s.resumed_from, s.snapshot_id = "run-a", 3, 7, 8
    [b] = s.on_fragment(1.0, upload(0))
    assert (b.msg.run_id, b.msg.epoch, b.msg.resumed_from) == ("run-a", 3, 7)
    assert not hasattr(b.msg, "snapshot")  # a SnapshotCut of its own (core.snapshots)


def test_uploads_of_an_earlier_incarnation_are_dropped():
    s = syncer()
    s.epoch = 2
    assert s.on_fragment(1.0, dataclasses.replace(upload(0), epoch=1)) == []
    assert s.stats.stale_epoch == 1 and s.version == [0, 0]
    [b] = s.on_fragment(1.0, dataclasses.replace(upload(0), epoch=2))
    assert b.msg.epoch == 2


def _update(s, m=1):
    [b] = s.on_fragment(1.0, upload(m))
    return b.msg


def test_a_learner_follows_a_resumed_syncer_by_rejoining_and_drops_the_old_incarnation():
    core = joined()
    s = syncer()
    s.run_id, s.epoch, s.resumed_from = "run-a", 2, 5
    u = _update(s)
    assert core.on_update(0.0, u) == [Rejoin(2, 5)]
    assert core.on_update(0.0, u) == []  # asked once
    acts = core.join("run-a", 2, 5, [(s.theta[0], 1), (s.theta[1], 0)], 40)
    assert [type(a) for a in acts] == [ApplyGlobal, ApplyGlobal] and core.epoch == 2 and core.version == [1, 0]
    old = syncer()
    old.run_id, old.epoch = "run-a", 1
    assert core.on_update(0.0, _update(old)) == [] and core.stale_updates == 1


def test_a_syncer_restarted_without_a_snapshot_stops_the_learner_with_a_clear_error():
    core = joined()
    s = syncer()
    s.run_id, s.epoch, s.resumed_from = "run-a", 2, 0
    with pytest.raises(IncarnationError, match="restarted from scratch.*--resume"):
        core.on_update(0.0, _update(s))


def test_a_syncer_of_another_run_stops_the_learner():
    core = joined(run_id="run-a")
    s = syncer()
    s.run_id = "run-b"
    with pytest.raises(IncarnationError, match="serves run 'run-b'; this learner belongs to run 'run-a'"):
        core.on_update(0.0, _update(s))
    with pytest.raises(IncarnationError):
        core.join("run-b", 1, 0, [(PARAMS, 0), (PARAMS, 0)], 0)


def test_a_learner_writes_its_part_when_a_snapshot_is_announced_and_reports_it():
    core = joined()
    assert core.on_snapshot_cut(0.0, SnapshotCut(4, 1)) == [SaveState(4)]
    assert core.on_snapshot_cut(0.0, SnapshotCut(4, 1)) == []  # announced again (a reconnected stream): written
    assert core.on_snapshot_cut(0.0, SnapshotCut(3, 1)) == []  # an older cut
    assert core.metadata().snapshot == 0
    core.saved(4)
    assert core.metadata().snapshot == 4 and core.metadata().epoch == 1


def test_a_cut_announced_during_a_step_is_written_after_it_and_stale_or_early_cuts_are_not():
    core = joined()
    core.begin_step(0.0)
    assert core.on_snapshot_cut(0.0, SnapshotCut(5, 1)) == []
    assert core.step_done(1.0, 10).count(SaveState(5)) == 1
    core.begin_step(1.5)
    assert SaveState(5) not in core.step_done(2.0, 10)  # once
    assert joined(epoch=2).on_snapshot_cut(0.0, SnapshotCut(9, 1)) == []  # of an incarnation it no longer follows
    assert learner().on_snapshot_cut(0.0, SnapshotCut(9, 1)) == []  # not joined: no state of the run to keep


# ---- snapshot state ----------------------------------------------------------------------


def test_syncer_export_restore_roundtrip_continues_identically():
    a = syncer(outer=OuterConfig(lr=0.7, momentum=0.9))
    a.run_id = "run-a"
    for k in range(3):
        a.on_fragment(float(k), upload(k % 3, due=4 * (k + 1), base_version=a.version[0]))
    tensors, info = a.export()
    b = syncer(outer=OuterConfig(lr=0.7, momentum=0.9))
    b.restore({n: np.array(v) for n, v in tensors.items()}, info)
    assert b.version == a.version and b.global_step == a.global_step and b.merged_at == a.merged_at
    [ua] = a.on_fragment(9.0, upload(1, due=20, base_version=a.version[0]))
    [ub] = b.on_fragment(9.0, upload(1, due=20, base_version=b.version[0]))
    assert all(np.array_equal(ua.msg.update[n], ub.msg.update[n]) for n in ua.msg.update)  # momentum restored


def test_syncer_restore_refuses_a_snapshot_of_another_layout_and_changes_nothing():
    a = syncer()
    tensors, info = a.export()
    b = syncer()
    with pytest.raises(ValueError, match="fragments differ"):
        b.restore(tensors, {**info, "fragments": [["x"]]})
    bad = dict(tensors)
    bad["theta/0/block_0/w"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match="theta/0/block_0/w"):
        b.restore(bad, info)
    assert b.version == [0, 0] and b.theta[0]["block_0/w"] is not bad["theta/0/block_0/w"]
