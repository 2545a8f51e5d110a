"""sim/start_end.py: the start barrier (core.barrier) holds a simulated run until enough learners joined, and
every learner's final sync (core.final_sync) gives its verdict in the result."""
import pytest

from wan_diloco.sim.start_end import RunFailed
from wan_diloco.tape import Outage

from . import test_faults as tf


def barrier_spec(**run):
    return tf.spec().with_changes(run={"min_learners_to_start": 3, **run})


def test_a_late_learner_holds_the_start_barrier_until_it_joins():
    s, r = tf.run(barrier_spec(), [Outage(2, 0.0, 4.0)])
    (met,) = tf.events(s, "barrier_met")
    (up,) = tf.events(s, "learner_up", learner=2)
    assert met["at_s"] == up["at_s"] > 4.0 and met["joined"] == [0, 1, 2]
    assert min(t for l in s.learners for t, _ in l.intervals) == met["at_s"]  # nobody stepped before
    assert not tf.events(s, "recovered")  # nobody trained before it joined: nothing to copy
    assert r.final_eval_loss < r.initial_eval_loss


def test_a_barrier_not_met_in_time_fails_the_run_naming_who_never_joined():
    with pytest.raises(RunFailed, match=r"never joined: learner-2$"):
        tf.run(barrier_spec(start_timeout_s=2.0), [Outage(2, 0.0, 4.0)])


def test_the_final_sync_verdict_of_every_learner_up_at_the_end_is_in_the_result():
    s, r = tf.run(tf.spec(), [Outage(1, 5.0, 7.0)])
    versions = list(s.syncer.version)
    assert r.final_sync == [{"learner": m, "versions": versions, "final_by_bulk": 0, "digest_mismatch": []}
                            for m in range(3)]
    assert r.to_json()["final_sync"] == r.final_sync
