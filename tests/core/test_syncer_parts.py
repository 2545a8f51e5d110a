"""The syncer core's parts that are functions of plain values (core.syncer_guards, core.syncer_rounds,
core.syncer_state), and what the core gains from them: a snapshot is read whole before any of it is taken."""
import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.core import ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.core.syncer_guards import (
    CLOCK_ADVANCE, OTHER_CLOCK_SLACK, check_clock, norm_excess, syncer_clock_limit,
)
from wan_diloco.core.syncer_rounds import Round, final_rounds, fold_carried

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload

NODES = {"learner-0", "learner-1", "syncer"}


def test_a_shards_own_clock_entry_may_carry_every_shards_ticks_a_whole_syncer_only_its_own():
    assert syncer_clock_limit(restored=5, ticks=3, leeway=0, shards_fragments=None) == 8
    assert syncer_clock_limit(restored=5, ticks=3, leeway=7, shards_fragments=None) == 15
    assert syncer_clock_limit(restored=5, ticks=3, leeway=0, shards_fragments=4) == 5 + 12 + CLOCK_ADVANCE


def test_a_clock_entry_is_bounded_by_what_the_syncer_knows_of_its_node():
    known = VectorClock({"learner-0": 10, "learner-1": 10})
    check_clock(0, VectorClock({"learner-0": 10 + CLOCK_ADVANCE, "learner-1": 10 + OTHER_CLOCK_SLACK, "syncer": 4}),
                known, NODES, 2, syncer_limit=4)
    for clock in ({"learner-1": 11 + OTHER_CLOCK_SLACK}, {"syncer": 5}, {"learner-0": 11 + CLOCK_ADVANCE},
                  {"learner-7": 1}):
        with pytest.raises(ProtocolError) as e:
            check_clock(0, VectorClock(clock), known, NODES, 2, syncer_limit=4)
        assert e.value.field == "clock"


def test_an_outer_gradient_past_the_ratio_of_thetas_norm_names_its_fragment():
    assert norm_excess(1, delta_sq=100.0, theta_sq=1.0, max_delta_ratio=10.0) is None  # exactly at the limit
    why = norm_excess(1, delta_sq=100.1, theta_sq=1.0, max_delta_ratio=10.0)
    assert why is not None and "fragment 1" in why
    assert norm_excess(0, delta_sq=0.81, theta_sq=0.0, max_delta_ratio=1.0) is None  # max(|Θ|, 1): never below 1


def test_carried_deltas_join_a_learners_held_own_and_stale_ones_are_dropped():
    rnd = Round(opened_s=0.0, contributions={0: upload(0, base_version=3, c_steps=8, c_tokens=800)}, held={0})
    carried = {0: upload(0, base_version=2, c_steps=2, c_tokens=200), 1: upload(1, base_version=0)}
    fold, keep, stale = fold_carried(rnd, carried, oldest_base=1)  # learner 1's is based before version 1
    assert (len(fold), keep, stale) == (1, {}, 1)
    mine = rnd.contributions[0]
    assert sorted(rnd.contributions) == [0] and fold[0] is mine
    assert (mine.c_steps, mine.c_tokens, mine.base_version) == (10, 1000, 2)
    np.testing.assert_allclose(mine.delta["block_0/w"], 0.2)


def test_a_late_delta_whose_learner_is_already_in_the_sums_waits_for_the_next_round():
    rnd = Round(opened_s=0.0, contributions={0: upload(0, base_version=3)})  # folded: not held
    late = upload(0, base_version=2)
    fold, keep, stale = fold_carried(rnd, {0: late, 1: upload(1, base_version=2)}, oldest_base=1)
    assert keep == {0: late} and [u.learner for u in fold] == [1] and stale == 0
    assert sorted(rnd.contributions) == [0, 1]


def test_the_final_sync_has_one_round_per_owned_fragment_at_its_latest_due_step():
    finals = {(0, 0): upload(0, 0, due=8), (1, 0): upload(1, 0, due=16), (1, 1): upload(1, 1, due=16)}
    rounds = final_rounds(finals, owned=(0,), now_s=3.0)
    [(key, rnd)] = rounds
    assert key == (0, 16) and sorted(rnd.contributions) == [0, 1] and rnd.received_s == {0: 3.0, 1: 3.0}


def test_a_snapshot_with_a_counter_missing_changes_nothing():
    s = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    s.on_fragment(0.0, upload(0))
    tensors, info = s.export()
    before = (s.version[:], s.global_step, s.run_id, {n: a.copy() for n, a in s.theta[0].items()})
    t2 = {n: a + 1.0 if n.startswith("theta/") else a for n, a in tensors.items()}
    with pytest.raises(KeyError):
        s.restore(t2, {k: v for k, v in info.items() if k != "run_id"})
    assert (s.version, s.global_step, s.run_id) == before[:3]
    np.testing.assert_array_equal(s.theta[0]["block_0/w"], before[3]["block_0/w"])
    s.restore(t2, info)
    np.testing.assert_array_equal(s.theta[0]["block_0/w"], before[3]["block_0/w"] + 1.0)
