"""sim/resume.py: a learner restarted with --resume takes up its own state through core.restore.Resume, as the
runtime's: its part of the snapshot the syncer resumed from (inner optimizer, residuals, data position),
else the data position the syncer kept and a peer's state. Micro runs as tests/sim/test_faults.py's."""
import numpy as np

from wan_diloco import sim, tree
from wan_diloco.assemble import Assembly
from wan_diloco.core.peer import position_from_bytes
from wan_diloco.sim.resume import opt_digest
from wan_diloco.tape import Outage, SyncerOutage

from . import test_faults as tf

# The syncer dies at 7 s (its snapshot 1 is complete, the next not cut yet), the learners a moment later; the
# syncer comes back at 8 s, the learners at 8.5 s: a whole cluster restarted with --resume.
CLUSTER_RESTART = [SyncerOutage(7.0, 8.0)] + [Outage(m, 7.1, 8.5) for m in range(3)]


def restarted(tape):
    """A simulation of ``tf.spec()`` under ``tape``, recording each part install as it happens."""
    cfg = tf.spec()
    s = sim.Simulation(sim.protocol_for(cfg), Assembly(cfg), list(tape))
    installs, install = [], s._install_part

    def spy(m, resume, a):
        out = install(m, resume, a)
        l = s.learners[m]
        part_opt = tree.from_named(a.tensors, "opt", l.state.opt_state, "part")
        installs.append({"learner": m, "snapshot": a.snapshot, "data": l.batches.position() == a.data,
                         "opt": opt_digest(l.state) == opt_digest(l.state.replace(opt_state=part_opt)),
                         "feedback": l.core.feedback.state_dict().keys() == {k[9:] for k in a.tensors
                                                                             if k.startswith("feedback/")}})
        return out

    s._install_part = spy
    return s, s.run(), installs


def test_a_cluster_restarted_with_the_syncer_takes_up_its_own_parts_deterministically():
    a, ra, installs = restarted(CLUSTER_RESTART)
    (resumed,) = tf.events(a, "syncer_resumed")
    snap = resumed["snapshot"]
    assert snap >= 1 and resumed["epoch"] == 2
    for m in range(3):  # each learner read its part of that snapshot and installed it: nobody to recover from
        (joined,) = tf.events(a, "joined", learner=m)
        assert joined["epoch"] == 2 and joined["resumed_from"] == snap
        assert [e["snapshot"] for e in tf.events(a, "resumed", learner=m)] == [snap]
        assert not tf.events(a, "recovered", learner=m) and not tf.events(a, "warning", learner=m)
    assert installs == [{"learner": m, "snapshot": snap, "data": True, "opt": True, "feedback": True} for m in range(3)]
    assert any(c for t, _, c in tf.merges(a) if t > 8.5)  # and they train on
    b, rb, _ = restarted(CLUSTER_RESTART)
    assert a.faults == b.faults and tf.merges(a) == tf.merges(b)
    assert all(np.array_equal(ra.params[n], rb.params[n]) for n in ra.params)
    tf.assert_every_copy_is_the_syncers(a)


def test_a_restarted_learner_goes_on_from_the_data_position_the_syncer_kept_then_takes_a_peers_state():
    # Learner 1 dies 0.2 s into a step: the batch of that step is drawn again, from the position its last
    # metadata carried (it reached the syncer at 5.03 s).
    s = sim.Simulation(tf.spec(), Assembly(tf.spec()), [Outage(1, 5.2, 7.0)])
    at_death, restart = {}, s._restart  # a learner down draws nothing, and the syncer hears nothing of it
    s._restart = lambda m: (at_death.update(drawn=s.learners[m].batches.drawn,
                                            kept=position_from_bytes(s.positions.of(m).encode())), restart(m))[1]
    s.run()
    (taken,) = tf.events(s, "data_position", learner=1)
    assert taken["restored"] and taken["batches"] == at_death["kept"]["batches"] == at_death["drawn"] - 1
    assert [w["what"] for w in tf.events(s, "warning", learner=1)] == [
        "--resume: learner 1: nothing to resume (the syncer started fresh, not from a snapshot)"]
    (rec,) = tf.events(s, "recovered", learner=1)  # then a peer's state, as before
    (donated,) = tf.events(s, "donated", recipient=1)
    assert rec["from_peer"] and rec["opt_digest"] == donated["opt_digest"] and rec["at_s"] > 7.0
