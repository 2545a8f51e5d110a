import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.core import GlobalUpdate, ProtocolError
from wan_diloco.core.messages import SnapshotCut
from wan_diloco.runtime.serde import BulkFragment
from wan_diloco.core.shards import OTHER_SHARD_RESUMED, ShardView

PLAN = [0, 1, 0, 1]  # fragment -> shard


def update(p, epoch, resumed_from=0):
    return GlobalUpdate(fragment=p, from_version=0, to_version=1, due_step=4, global_step=4, clock=VectorClock(),
                        update={"w": np.zeros(2, np.float32)}, nbytes=8, contributors=(0,), held_s={},
                        run_id="r", epoch=epoch, resumed_from=resumed_from)


def test_fresh_shards_look_like_one_syncer_of_incarnation_one():
    v = ShardView(PLAN)
    assert v.seen(0, 1, 0) == (1, 0) and v.seen(1, 1, 0) == (1, 0)
    assert v.outgoing(0, 1) == v.outgoing(1, 1) == 1 and v.shard_of(3) == 1


def test_a_resumed_shard_moves_the_combined_epoch_and_messages_map_back_per_shard():
    v = ShardView(PLAN)
    v.seen(0, 1, 0), v.seen(1, 1, 0)
    assert v.seen(1, 2, 7) == (2, OTHER_SHARD_RESUMED)  # shard 1 resumed from its snapshot 7: the learner rejoins
    assert v.outgoing(0, 2) == 1 and v.outgoing(1, 2) == 2  # shard 0 kept its incarnation
    assert v.outgoing(1, 1) == 1  # stamped before the resume: shard 1 drops it as stale
    assert v.seen(1, 1, 0)[0] == 1  # an update of shard 1's old incarnation is stale for the learner
    assert v.seen(0, 1, 0) == (2, OTHER_SHARD_RESUMED)  # shard 0's updates are of the current E
    assert v.seen(0, 2, 9) == (3, 9)  # then shard 0 resumes too: its snapshot holds the learners' parts
    assert v.outgoing(0, 3) == 2 and v.outgoing(1, 3) == 2


def test_updates_must_come_from_their_owner():
    v = ShardView(PLAN)
    assert v.update(1, update(1, 1)).epoch == 1
    with pytest.raises(ProtocolError, match="fragment 1 came from syncer shard 0; its owner is shard 1"):
        v.update(0, update(1, 1))
    bulk = BulkFragment(3, 5, 4, {}, "r", 2, 4)
    assert v.update(1, bulk) == bulk._replace(epoch=2, resumed_from=OTHER_SHARD_RESUMED)  # not shard 1's 4
    with pytest.raises(ProtocolError, match="fragment 4 out of range"):
        v.shard_of(4)


def test_snapshot_announcements_are_shard_zeros_only_in_the_learners_terms():
    v = ShardView(PLAN)
    v.seen(0, 1, 0), v.seen(1, 1, 0)
    assert v.cut(0, SnapshotCut(3, 1)) == SnapshotCut(3, 1)
    with pytest.raises(ProtocolError, match="from syncer shard 1; learners write their parts into shard 0's") as e:
        v.cut(1, SnapshotCut(11, 1))  # shard 1's own numbering never reaches the learner
    assert e.value.field == "cut"
    v.seen(1, 2, 7)  # shard 1 resumed: E = 2, shard 0 still at its incarnation 1
    assert v.cut(0, SnapshotCut(4, 1)) == SnapshotCut(4, 2)
    v.seen(0, 2, 4)  # shard 0 resumed too: E = 3; a cut of its old incarnation is stale (an earlier E)
    assert v.cut(0, SnapshotCut(5, 2)).epoch == 3 and v.cut(0, SnapshotCut(4, 1)).epoch == 2
    with pytest.raises(ProtocolError, match="incarnation 3, which its update stream has not named"):
        v.cut(0, SnapshotCut(6, 3))


def test_messages_without_an_incarnation_pass_unchanged():
    v = ShardView(PLAN)
    assert v.seen(1, 0, 0) == (0, 0) and v.outgoing(1, 0) == 0
    assert v.update(0, update(0, 0)).epoch == 0


def test_a_learner_is_told_a_snapshot_of_its_own_parts_only_when_shard_zero_resumed_last():
    v = ShardView(PLAN)
    v.seen(0, 1, 0), v.seen(1, 1, 0)
    # Shard 1 resumes from its snapshot 12 while shard 0 has cut 3: 12 is not a snapshot of the learners' parts
    # (taken for one, the learner would skip writing its parts of shard 0's snapshots 4..12).
    v.cut(0, SnapshotCut(3, 1))
    E, resumed = v.seen(1, 2, 12)
    assert (E, resumed) == (2, OTHER_SHARD_RESUMED) and resumed < 3 and resumed  # below every id, yet "resumed"
    assert v.update(1, update(1, 2, resumed_from=12)).resumed_from == OTHER_SHARD_RESUMED
    assert v.seen(0, 2, 3) == (3, 3)  # shard 0 resumes from its 3: the learners' parts of 3 are its state
    # Shard 1 resumes again: shard 0 lost nothing since its resume, so nobody goes back to its snapshot 3.
    assert v.seen(1, 3, 14) == (4, OTHER_SHARD_RESUMED)
    assert v.seen(0, 3, 5) == (5, 5)
    starting = ShardView(PLAN)  # a learner started after both resumed hears each for the first time: no change
    assert starting.seen(1, 3, 14) == (3, OTHER_SHARD_RESUMED) and starting.seen(0, 3, 5) == (5, 5)


def test_a_rejoin_refetches_the_fragments_of_the_shards_that_resumed_only():
    v = ShardView(PLAN)
    v.seen(0, 1, 0), v.seen(1, 1, 0)
    assert v.refetch(1) == []  # nothing resumed
    v.seen(1, 2, 7)  # shard 1 resumed: E = 2
    assert v.refetch(1) == [1, 3] and v.refetch(2) == []
    v.seen(0, 2, 5)  # then shard 0: E = 3
    assert v.refetch(2) == [0, 2] and v.refetch(1) == [0, 1, 2, 3]  # both since E = 1
    assert v.refetch(0) == v.refetch(9) == [0, 1, 2, 3]  # never joined, or an E this view never stood at
