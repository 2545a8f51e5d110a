"""core.restore: where a (re)starting learner's state comes from, as events in and actions out."""
from wan_diloco.core.reports import Report
from wan_diloco.core.restore import InstallPart, LoadPart, RecoverFromPeer, Resume, TakeUpPosition, trained_past

INFO = {"run_id": "run-a", "learner": 1, "train_step": 30, "step": 32, "tokens": 900, "data": {"batches": 4}}


def resume(resume=True, peer_recovery=True, learners=3):
    return Resume(1, resume, peer_recovery, learners, donor_timeout_s=20.0)


def reports(actions):
    return [a.event for a in actions if isinstance(a, Report)]


def others(actions):
    return [a for a in actions if not isinstance(a, Report)]


def test_a_fresh_start_takes_nothing_and_a_late_joiner_takes_a_peers_state_without_waiting():
    assert resume(resume=False).on_joined(0.0, "run-a", 0, 0, None) == []  # nobody trained yet
    r = resume(resume=False)
    assert r.on_joined(0.0, "run-a", 0, 50, None) == [TakeUpPosition(), RecoverFromPeer(0.0)]
    assert others(resume(resume=False, peer_recovery=False).on_joined(0.0, "run-a", 0, 50, None)) == [TakeUpPosition()]


def test_resume_with_nothing_to_resume_says_why_and_goes_on_as_a_join():
    fresh = resume().on_joined(0.0, "run-a", 0, 50, (2,))
    assert "the syncer started fresh" in reports(fresh)[0]["what"]
    assert others(fresh) == [TakeUpPosition(), RecoverFromPeer(0.0)]  # no snapshot: its peers are not resuming
    no_store = resume().on_joined(0.0, "run-a", 4, 50, None)
    assert "checkpoint.dir is empty" in reports(no_store)[0]["what"]
    assert others(no_store) == [TakeUpPosition(), RecoverFromPeer(20.0)]  # its peers take up their parts: wait


def test_only_another_shard_resumed_last_so_no_part_of_its_own_is_taken_up():
    from wan_diloco.core.shards import OTHER_SHARD_RESUMED

    got = resume().on_joined(0.0, "run-a", OTHER_SHARD_RESUMED, 50, (2, 4))
    assert "shard 0, which keeps the learners' parts, did not resume last" in reports(got)[0]["what"]
    assert others(got) == [TakeUpPosition(), RecoverFromPeer(0.0)]  # its peers keep their state: no wait


def test_its_own_part_is_taken_up_with_its_counters():
    r = resume()
    assert r.on_joined(0.0, "run-a", 4, 32, (2, 4)) == [LoadPart(4, fallback=False)]
    [install] = r.on_part(0.1, 4, False, {"opt/x": 1}, INFO)
    assert install == InstallPart(4, False, {"opt/x": 1}, {"batches": 4}, 30, 32, 900)
    [said] = r.on_installed(0.2, 4, False, 40)
    assert said.event == {"event": "resumed", "role": "learner", "learner": 1, "snapshot": 4, "step": 40}
    assert r.restored and r.recovery is None


def test_a_learner_that_trained_past_the_snapshot_takes_a_peers_state_instead():
    assert trained_past(4, (2, 4, 6, 8)) == 8 and trained_past(8, (2, 4, 6, 8)) is None
    r = resume()
    r.on_joined(0.0, "run-a", 4, 32, (2, 4, 6))
    out = r.on_part(0.1, 4, False, {}, INFO)
    assert "trained past snapshot 4" in reports(out)[0]["what"] and "snapshot 6" in reports(out)[0]["what"]
    assert others(out) == [TakeUpPosition(), RecoverFromPeer(20.0)]
    # Not unusable: with no peer it goes on from Θ alone, never back to an older part of its own.
    out = r.on_peer(5.0, {"from_peer": False, "why": "no healthy learner"}, 32)
    assert others(out) == [] and "no peer state (no healthy learner)" in reports(out)[0]["what"]
    assert r.recovery == {"from_peer": False, "why": "no healthy learner"}


def test_a_broken_part_falls_back_to_a_peer_then_to_the_newest_earlier_part_that_verifies():
    r = resume(peer_recovery=True, learners=1)
    r.on_joined(0.0, "run-a", 6, 32, (1, 2, 4, 6))
    out = r.on_part_failed(0.1, 6, False, "checksum mismatch")
    assert "no usable part of snapshot 6 (checksum mismatch)" in reports(out)[0]["what"]
    assert others(out) == [TakeUpPosition(), RecoverFromPeer(0.0)]  # one learner: no peer to wait for
    out = r.on_peer(1.0, {"from_peer": False, "why": "no healthy learner"}, 32)
    assert "fresh inner optimizer" in reports(out)[0]["what"] and others(out) == [LoadPart(4, fallback=True)]
    # An earlier part of another run is skipped, as is one the store cannot read.
    assert r.on_part(1.1, 4, True, {}, {**INFO, "run_id": "run-b"}) == [LoadPart(2, fallback=True)]
    assert r.on_part_failed(1.2, 2, True, "missing") == [LoadPart(1, fallback=True)]
    [install] = r.on_part(1.3, 1, True, {}, INFO)
    assert install.fallback and install.snapshot == 1
    out = r.on_installed(1.4, 1, True, 32)
    assert out[0].event["fallback"] is True and "earlier snapshot 1" in out[1].event["what"]
    assert r.recovery == {"from_peer": False, "from_snapshot": 1} and r.restored


def test_no_earlier_part_means_a_fresh_state_and_a_peers_state_ends_the_search():
    r = resume(peer_recovery=False)
    r.on_joined(0.0, "run-a", 6, 32, (6,))
    out = r.on_part(0.1, 6, False, {}, {**INFO, "learner": 2})  # another learner's part
    assert "learner 2" in reports(out)[0]["what"] and others(out) == [TakeUpPosition()]
    assert "no peer state and no earlier part" in reports(out)[-1]["what"]

    r = resume()
    r.on_joined(0.0, "run-a", 6, 32, (4, 6))
    r.on_part_failed(0.1, 6, False, "broken")
    out = r.on_peer(2.0, {"from_peer": True, "donor": 0, "bytes": 10}, 40)
    assert out == [Report({"event": "recovered", "role": "learner", "learner": 1, "step": 40,
                           "from_peer": True, "donor": 0, "bytes": 10})]


def test_a_part_without_its_counters_is_unusable_and_at_a_runs_start_nothing_follows():
    r = resume()
    r.on_joined(0.0, "run-a", 6, 0, (4, 6))
    out = r.on_part(0.1, 6, False, {}, {k: v for k, v in INFO.items() if k != "tokens"})
    assert "'tokens'" in reports(out)[0]["what"] and others(out) == []  # global step 0: nobody trained yet
