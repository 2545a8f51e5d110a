"""The start barrier (core.barrier): no learner trains before enough have joined; a late or rejoining
learner does not wait; a barrier not met in time names who never joined."""
import pytest

from wan_diloco.core.barrier import BarrierView, StartBarrier, barrier_need


def test_the_barrier_is_met_once_enough_learners_joined_and_stays_met():
    b = StartBarrier(need=2, learners=3, timeout_s=10.0)
    b.open(0.0)
    assert not b.on_joined(1.0, 2) and not b.started
    assert b.status() == {"need": 2, "joined": [2], "waiting_for": [0, 1], "started": False}
    assert not b.on_joined(1.5, 2)  # the same learner again counts once
    assert b.on_joined(2.0, 0) and b.started  # this join met it: the driver announces it
    assert not b.on_joined(3.0, 1) and b.started  # a late joiner: met already, nothing to announce
    assert not b.expired(1e9)


def test_a_barrier_not_met_in_time_fails_naming_the_learners_that_never_joined():
    b = StartBarrier(need=3, learners=3, timeout_s=10.0)
    b.open(100.0)
    b.on_joined(101.0, 1)
    assert not b.expired(110.0) and b.expired(110.5)
    line = b.failure()
    assert "learner-0, learner-2" in line and "learner-1" not in line.partition("never joined")[2]
    assert "run.start_timeout_s" in line and "\n" not in line


def test_need_defaults_to_one_and_is_checked():
    assert barrier_need(0, 4) == 1 and barrier_need(3, 4) == 3
    with pytest.raises(ValueError, match="min_learners_to_start"):
        StartBarrier(need=5, learners=4, timeout_s=1.0)
    with pytest.raises(ValueError, match="start_timeout_s"):
        StartBarrier(need=1, learners=4, timeout_s=0.0)


def test_a_learner_waits_until_the_syncer_says_started_and_never_again():
    v = BarrierView(timeout_s=5.0)
    assert v.must_wait(0.0)
    assert v.on_status(False, 2, (0,), (1,)) and not v.on_status(False, 2, (0,), (1,))  # a change, then none
    assert v.must_wait(1.0) and not v.expired(4.0) and v.expired(5.5)
    assert "learner-1" in v.failure()
    v.on_status(True, 2, (0, 1), ())
    assert not v.must_wait(6.0) and not v.expired(100.0)
    v.on_status(False, 2, (0,), (1,))  # an older frame after a reconnect cannot take the start back
    assert v.started and not v.must_wait(7.0)


def test_barrier_events_announce_each_join_and_fail_the_run_once():
    from wan_diloco.core.barrier import AnnounceBarrier, FailRun

    b = StartBarrier(need=2, learners=3, timeout_s=10.0)
    assert b.on_tick(0.0) == []
    [a] = b.on_metadata(1.0, 0)
    assert a == AnnounceBarrier({"need": 2, "joined": [0], "waiting_for": [1, 2], "started": False}, met=False)
    assert b.on_metadata(2.0, 0) == []  # not its first metadata
    assert b.on_tick(10.5) == [FailRun(b.failure())] and b.failed and b.on_tick(11.0) == []
    ok = StartBarrier(need=1, learners=2, timeout_s=10.0)
    assert ok.on_metadata(1.0, 1)[0].met and ok.on_tick(100.0) == []
    resumed = StartBarrier(need=2, learners=2, timeout_s=10.0)
    resumed.resumed(True)
    assert resumed.started and not resumed.on_metadata(0.0, 0)[0].met
