"""The simulator replays every fault of a failure tape through the same core code as the runtime: a syncer
killed and resumed from its snapshot, a shard killed and resumed while the other merges on, a learner
recovered from a peer with the peer's optimizer, a learner that joins late; deterministically.

Micro runs: 3 learners, a step every 0.5 virtual s, H = 8, P = 4 (a merge about every second), a snapshot
every 4 merges."""
import numpy as np
import pytest

from wan_diloco import sim
from wan_diloco.assemble import Assembly
from wan_diloco.config import ConfigError
from wan_diloco.core.restore import LoadPart, RecoverFromPeer, Resume
from wan_diloco.core.shards import OTHER_SHARD_RESUMED
from wan_diloco.tape import Outage, SyncerOutage

from .micro import micro


def spec(every_merges=4, **kw):
    return micro(steps=32, eval_every=32, **kw).with_changes(checkpoint={"every_merges": every_merges})


def run(cfg, tape):
    s = sim.Simulation(sim.protocol_for(cfg), Assembly(cfg), list(tape))
    return s, s.run()


def events(s, name, **match):
    return [f for f in s.faults if f["event"] == name and all(f.get(k) == v for k, v in match.items())]


def merges(s, cores=None):
    cores = cores if cores is not None else (s.syncer.cores if s.sharded else [s.syncer])
    return sorted((t, p, c) for core in cores for t, p, _, c in core.stats.history)


def assert_every_copy_is_the_syncers(s):
    for l in s.learners:
        for p, frag in enumerate(s.syncer.theta):
            for n, a in frag.items():
                np.testing.assert_array_equal(l.core.base[p][n], a)


def test_a_killed_syncer_resumes_from_its_newest_complete_snapshot_and_the_learners_rejoin():
    s, r = run(spec(), [SyncerOutage(9.0, 11.0)])
    (resumed,) = events(s, "syncer_resumed")
    snap = resumed["snapshot"]
    assert resumed["epoch"] == 2 and snap >= 1 and s.syncer.resumed_from == snap
    keeper = s.keepers[0]
    # The newest snapshot complete at the kill (cut every 4 merges, complete once every learner wrote its part).
    assert snap == max(k for k, t in keeper.complete_s.items() if t <= 9.0)
    assert resumed["versions"] == keeper.syncer_parts[snap][1]["versions"] == keeper.manifests[snap]["versions"]
    assert keeper.parts_written >= 3  # the learners wrote their parts (SaveState) and the syncer heard of it
    for m in range(3):  # every learner met the new incarnation and took its model up through LearnerCore.join
        (joined,) = events(s, "rejoined", learner=m)
        assert joined["epoch"] == 2 and joined["resumed_from"] == snap and joined["at_s"] > 11.0
        assert s.learners[m].core.epoch == 2
    after = [c for t, _, c in merges(s) if t > 11.0]
    assert after and {m for c in after for m in c} == {0, 1, 2}  # all three train on into the resumed syncer
    assert r.final_eval_loss < r.initial_eval_loss
    assert_every_copy_is_the_syncers(s)


def test_a_syncer_killed_twice_without_a_complete_snapshot_between_gets_a_new_incarnation_each_time():
    tape = [SyncerOutage(9.0, 11.0), SyncerOutage(11.5, 12.5)]  # the next cut completes about 4 merges after 11 s
    s, _ = run(spec(), tape)
    first, second = events(s, "syncer_resumed")
    assert first["snapshot"] == second["snapshot"]  # nothing complete in between: the same snapshot twice
    assert (first["epoch"], second["epoch"]) == (2, 3)  # not 2 twice: the dead incarnation's messages are stale
    for m in range(3):  # the learners rejoined both incarnations
        assert [j["epoch"] for j in events(s, "rejoined", learner=m)] == [2, 3]
        assert s.learners[m].core.epoch == 3
    assert_every_copy_is_the_syncers(s)


def test_nothing_merges_while_the_syncer_is_dead():
    heard = []
    s = sim.Simulation(spec(), Assembly(spec()), [SyncerOutage(9.0, 11.0)])
    upload = s._upload
    s._upload = lambda now_s, msg: (heard.append(now_s), upload(now_s, msg))[1]
    s.run()
    assert heard and not [t for t in heard if 9.0 <= t < 11.0]
    assert not [t for t, _, _ in merges(s) if 9.0 <= t < 11.0]


def test_a_learner_recovers_from_a_peer_with_the_peers_optimizer_through_donations():
    s, _ = run(spec(), [Outage(1, 5.0, 7.0)])
    (rec,) = events(s, "recovered", learner=1)
    (donated,) = events(s, "donated", recipient=1)  # sent by the donor's core.peer.Donor (tests/sim/test_donations.py)
    assert rec["donor"] == donated["learner"] in (0, 2) and rec["at_s"] > 7.0
    assert rec["opt_digest"] == donated["opt_digest"]  # the donor's inner optimizer, bit for bit
    assert s.donations.served == 1 and not s.donations.pending
    assert any(1 in c for t, _, c in merges(s) if t > 7.0)


def test_a_late_learner_draws_nothing_before_it_joins_and_contributes_after():
    s, _ = run(spec(), [Outage(2, 0.0, 4.0)])
    (rec,) = events(s, "recovered", learner=2)
    assert rec["at_s"] > 4.0  # its donor's state took time to come
    before = [c for t, _, c in merges(s) if t < 4.0]
    assert before and all(2 not in c for c in before)
    assert any(2 in c for t, _, c in merges(s) if t > 4.0)
    assert s.learners[2].intervals[0][0] >= rec["at_s"]  # its first step began once it held the state


def test_a_killed_shard_resumes_from_its_own_snapshot_while_the_other_keeps_merging():
    # Shards own 2 fragments each: a snapshot every 2 of its own merges.
    s, _ = run(spec(shards=2, every_merges=2), [SyncerOutage(8.0, 11.0, shard=1)])
    (resumed,) = events(s, "syncer_resumed")
    assert resumed["shard"] == 1 and resumed["epoch"] == 2
    shard0, shard1 = s.syncer.cores
    assert shard0.epoch == 1 and shard1.epoch == 2 and shard1.resumed_from == resumed["snapshot"]
    assert [t for t, _, _ in merges(s, [shard0]) if 8.0 < t < 11.0]  # shard 0 went on
    assert not [t for t, _, _ in merges(s, [shard1]) if 8.0 <= t < 11.0]
    assert [t for t, _, _ in merges(s, [shard1]) if t > 11.0]  # and shard 1 merges again after its resume
    assert {f["learner"] for f in events(s, "rejoined", epoch=2)} == {0, 1, 2}  # one syncer to them: E = 2
    # They fetched shard 1's fragments only (core.shards.ShardView.refetch): shard 0's copies are still current.
    owned = [p for p, owner in enumerate(s.syncer.plan) if owner == 1]
    assert 0 < len(owned) < 4 and [f["fetched"] for f in events(s, "rejoined", epoch=2)] == [owned] * 3
    assert_every_copy_is_the_syncers(s)


def test_learners_keep_writing_their_parts_of_shard_zeros_snapshots_after_another_shard_resumes():
    # 3 shards: shard 0 owns one fragment and cuts rarely; shard 1 resumes from its snapshot 3 while shard 0 has
    # cut 1. Told "resumed from 3", the learners took it for shard 0's and skipped their parts of its 2 and 3.
    s, _ = run(micro(steps=48, eval_every=48, shards=3).with_changes(checkpoint={"every_merges": 2}),
               [SyncerOutage(12.0, 13.0, shard=1)])
    (resumed,) = events(s, "syncer_resumed")
    keeper = s.keepers[0]
    assert resumed["shard"] == 1 and resumed["snapshot"] > min(keeper.complete)
    assert {j["resumed_from"] for j in events(s, "rejoined")} == {OTHER_SHARD_RESUMED}
    assert len(keeper.complete) >= 2 and not keeper.coordinator.pending  # each of shard 0's cuts completed
    for manifest in keeper.manifests.values():
        assert manifest["parts"] == ["syncer", "learner-0", "learner-1", "learner-2"]


def test_a_shard_resumed_after_shard_zero_did_sends_no_learner_back_to_shard_zeros_old_snapshot():
    s, _ = run(spec(shards=2, every_merges=2), [SyncerOutage(9.0, 10.0, shard=0), SyncerOutage(13.0, 14.0, shard=1)])
    zero, one = events(s, "syncer_resumed")
    assert (zero["shard"], one["shard"]) == (0, 1)
    for m in range(3):
        first, second = events(s, "rejoined", learner=m)
        assert first["resumed_from"] == zero["snapshot"]  # shard 0's state is its snapshot: the parts of it match
        assert second["resumed_from"] == OTHER_SHARD_RESUMED and second["step"] >= first["step"]
    # A learner that starts now with --resume recovers from a peer: shard 0 lost nothing since its snapshot.
    starting = Resume(0, True, True, 3, 20.0).on_joined(s.now, s.syncer.run_id, s.syncer.resumed_from, 30,
                                                        (zero["snapshot"],))
    assert not [a for a in starting if isinstance(a, LoadPart)] and RecoverFromPeer(0.0) in starting
    assert_every_copy_is_the_syncers(s)


# Shard 1 is killed twice with no snapshot of its own complete in between (both resumes take up its snapshot
# 1), then the whole syncer.
ALL_FAULTS = [Outage(2, 0.0, 3.0), Outage(1, 4.0, 5.5), SyncerOutage(6.0, 7.5, shard=1),
              SyncerOutage(8.0, 8.5, shard=1), SyncerOutage(12.0, 13.0)]


def test_a_tape_with_every_fault_replays_bit_identically():
    a, ra = run(spec(shards=2, every_merges=2), ALL_FAULTS)
    b, rb = run(spec(shards=2, every_merges=2), ALL_FAULTS)
    kinds = {f["event"] for f in a.faults}
    assert {"recovered", "syncer_resumed", "rejoined", "learner_down", "learner_up"} <= kinds
    resumed = events(a, "syncer_resumed")
    assert [(f["shard"], f["epoch"]) for f in resumed] == [(1, 2), (1, 3), (0, 2), (1, 4)]
    assert resumed[0]["snapshot"] == resumed[1]["snapshot"]  # one snapshot, two incarnations
    assert a.syncer.epoch == 5  # shard 1 resumed three times, shard 0 once
    # Learner 0 rejoined each: both shards came back at 13 s (E 4 and 5 at once), so it met 5 there.
    assert [f["epoch"] for f in events(a, "rejoined", learner=0)] == [2, 3, 5]
    assert a.faults == b.faults
    assert merges(a) == merges(b)
    assert ra.params.keys() == rb.params.keys() and all((ra.params[n] == rb.params[n]).all() for n in ra.params)
    assert ra.to_json() == {**rb.to_json(), "wall_s": ra.wall_s}


@pytest.mark.parametrize("tape, cfg, field", [
    ([SyncerOutage(1.0, 2.0, shard=2)], {"shards": 2}, "failures"),
    ([SyncerOutage(1.0, 2.0)], {"baseline": "dp"}, "failures"),
])
def test_a_tape_the_run_cannot_replay_names_the_field(tape, cfg, field):
    with pytest.raises(ConfigError, match=field):
        sim.check_tape(spec(**cfg), tape)
    with pytest.raises(ConfigError, match="checkpoint.every_merges"):
        sim.check_tape(micro().with_changes(checkpoint={"every_merges": 0}), [SyncerOutage(1.0, 2.0)])


def test_a_syncer_killed_before_any_snapshot_was_complete_fails_the_run_as_a_real_resume_would():
    from wan_diloco.core.snapshots import ResumeError

    with pytest.raises(ResumeError, match="no snapshot to resume from"):
        run(spec(), [SyncerOutage(1.0, 2.0)])  # the first cut comes after 4 merges, about 4 s in
