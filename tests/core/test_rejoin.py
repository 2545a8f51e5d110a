"""core.rejoin: a learner and the syncer incarnation it follows; the take-up of the global step."""
import numpy as np
import pytest

from wan_diloco.core import ApplyGlobal, IncarnationError, LearnerConfig, LearnerCore, Rejoin
from wan_diloco.core.rejoin import (
    Resynced, TakeUpStep, on_fetched, on_identity, rejoin_fragments, rejoin_report, same_incarnation, take_up_step,
)
from wan_diloco.core.shards import OTHER_SHARD_RESUMED

from .helpers import CODEC, FRAGS, PARAMS


def joined(epoch=2, resumed_from=4):
    lc = LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1), 0, FRAGS, PARAMS, CODEC)
    lc.join("run-a", epoch, resumed_from, [(PARAMS, 3), (PARAMS, 3)], 20)
    return lc


def test_a_syncer_resumed_as_a_new_incarnation_is_rejoined_and_the_same_one_is_followed():
    lc = joined()
    assert on_identity(lc, 0.0, "run-a", 2, 4, "p1") == []
    assert on_identity(lc, 0.0, "run-a", 3, 6, "p2") == [Rejoin(3, 6)]
    with pytest.raises(IncarnationError, match="another run|serves run"):
        on_identity(lc, 0.0, "run-b", 3, 6)


def test_a_resume_of_a_shard_other_than_zero_is_rejoined_and_skips_no_snapshot_of_the_learners_parts():
    lc = joined(epoch=2, resumed_from=4)
    lc.snapshot_seen = 5  # shard 0 announced its snapshot 5
    assert on_identity(lc, 0.0, "run-a", 3, OTHER_SHARD_RESUMED) == [Rejoin(3, OTHER_SHARD_RESUMED)]
    lc.join("run-a", 3, OTHER_SHARD_RESUMED, [(PARAMS, 3), (PARAMS, 3)], 20)
    assert lc.epoch == 3 and lc.snapshot_seen == 5  # it writes its part of shard 0's snapshot 6 when cut
    why = rejoin_report(0, 20, 3, OTHER_SHARD_RESUMED).event["why"]
    assert why == "a syncer shard other than 0 resumed (incarnation 3): the learner's own state stays"
    assert "from snapshot 4 as incarnation 2" in rejoin_report(0, 20, 2, 4).event["why"]


def test_a_fragment_fetched_after_a_gap_is_installed_if_newer_and_the_step_taken_up():
    lc = joined()
    values = {n: np.full_like(a, 7.0) for n, a in PARAMS.items()}
    out = on_fetched(lc, 0.0, "run-a", 2, 4, 1, values, 5, 30)
    assert isinstance(out[0], ApplyGlobal) and out[1:] == [Resynced(1, 5), TakeUpStep()]
    assert lc.version == [3, 5] and lc.step == 30
    assert on_fetched(lc, 0.0, "run-a", 2, 4, 1, values, 5, 30) == [TakeUpStep()]  # not newer: nothing to install
    assert on_fetched(lc, 0.0, "run-a", 1, 0, 1, values, 9, 40) == [TakeUpStep()]  # an older incarnation's
    assert on_fetched(lc, 0.0, "run-a", 3, 8, 1, values, 9, 40) == [Rejoin(3, 8)]  # the syncer came back meanwhile
    assert lc.version == [3, 5]


def test_a_join_retries_while_the_fetched_fragments_disagree_on_the_incarnation():
    assert same_incarnation([("run-a", 2), ("run-a", 2)])
    assert not same_incarnation([("run-a", 2), ("run-a", 3)])


def test_the_global_step_is_taken_up_where_the_learner_is_behind_only():
    assert take_up_step(300, 0, 0) == (300, 300)  # a fresh optimizer would warm up again
    assert take_up_step(300, 300, 350) == (None, None)  # a donor's optimizer ahead of the global step stays
    assert take_up_step(300, 310, 120) == (None, 300)


def test_a_rejoin_that_fetched_some_fragments_keeps_its_own_copies_of_the_rest():
    lc = joined()
    fresh = {n: np.full_like(a, 9.0) for n, a in PARAMS.items()}
    fragments = rejoin_fragments({1: (fresh, 1)}, lc.base, lc.version)
    assert fragments[0] == (lc.base[0], 3) and fragments[1] == (fresh, 1)
    lc.join("run-a", 3, OTHER_SHARD_RESUMED, fragments, 20)
    assert lc.version == [3, 1] and all((lc.base[1][n] == 9.0).all() for n in lc.fragments[1])
