"""#23 case 3 on the learner's side: a syncer that comes back at the same run id and incarnation with a
fresh model (restarted without --resume), or at a lower incarnation, stops the learner before it sends
anything more (``LearnerCore.meet``, fed by each update stream's Identity)."""
import pytest

from wan_diloco.core import IncarnationError, LearnerConfig, LearnerCore

from .helpers import CODEC, FRAGS, PARAMS


def joined(versions=(0, 0)):
    core = LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1), 0, FRAGS, PARAMS, CODEC)
    core.join("run-a", 1, 0, [(PARAMS, versions[0]), (PARAMS, versions[1])], 0)
    return core


def test_a_fresh_syncer_process_at_the_same_incarnation_stops_a_learner_with_merged_state():
    core = joined(versions=(3, 2))
    assert core.meet("run-a", 1, 0, "aaaa") == "same"  # the first stream: learnt, not compared
    assert core.meet("run-a", 1, 0, "aaaa") == "same"  # a reconnect to the same process
    with pytest.raises(IncarnationError, match=r"restarted from scratch.*versions \[3, 2\].*--resume"):
        core.meet("run-a", 1, 0, "bbbb")


def test_a_fresh_syncer_before_any_merge_is_no_fork():
    core = joined(versions=(0, 0))  # nothing merged yet: the fresh model is the one it started from
    core.meet("run-a", 1, 0, "aaaa")
    assert core.meet("run-a", 1, 0, "bbbb") == "same"


def test_a_syncer_at_a_lower_incarnation_stops_the_learner():
    core = LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1), 0, FRAGS, PARAMS, CODEC)
    core.join("run-a", 3, 7, [(PARAMS, 1), (PARAMS, 1)], 0)
    with pytest.raises(IncarnationError, match="incarnation 1, this learner already followed incarnation 3"):
        core.meet("run-a", 1, 0, "aaaa")


def test_a_sharded_syncer_is_compared_shard_by_shard():
    core = joined(versions=(2, 1))
    core.meet("run-a", 1, 0, "s0a,")  # shard 0 heard from first, shard 1 not yet
    assert core.meet("run-a", 1, 0, "s0a,s1a") == "same"  # shard 1's first word is no restart
    assert core.meet("run-a", 1, 0, ",s1a") == "same"  # a reconnect to shard 1 alone
    with pytest.raises(IncarnationError, match="restarted from scratch"):
        core.meet("run-a", 1, 0, "s0a,s1b")  # shard 1 came back fresh: the same E, no snapshot


def test_a_syncer_resumed_from_a_snapshot_is_rejoined_not_refused():
    core = joined(versions=(2, 1))
    core.meet("run-a", 1, 0, "aaaa")
    assert core.meet("run-a", 2, 4, "bbbb") == "new"
