"""Peer recovery, sans IO: donor choice and replacement, and a recipient that adopts a donor's state and
replays the updates sent meanwhile ends bit-identical to the syncer."""
import numpy as np
import pytest

from wan_diloco.core import LearnerConfig, LearnerCore, ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.core.recovery import AskDonor, Candidate, Donations, NoDonor, choose_donor

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload


def test_donor_choice_prefers_the_region_then_the_idle_then_the_advanced():
    c = {0: Candidate("eu", 10), 1: Candidate("us", 50), 2: Candidate("us", 40, busy=1), 3: Candidate("us", 30)}
    assert choose_donor(c, "us") == 1
    assert choose_donor({**c, 1: Candidate("us", 50, busy=2)}, "us") == 3  # idle beats advanced
    assert choose_donor(c, "eu") == 0
    assert choose_donor(c, "ap") == 1  # no one nearby: the best of the rest
    assert choose_donor(c, "us", frozenset({1, 2, 3})) == 0
    assert choose_donor({}, "us") is None


def test_a_donor_that_goes_away_is_replaced_and_nobody_left_means_no_donor():
    d = Donations(timeout_s=10.0)
    cands = {0: Candidate("us", 9), 1: Candidate("us", 8)}
    assert d.request(0.0, 2, (3, 4), cands, "us") == [AskDonor(0, 2, (3, 4))]
    assert d.request(0.5, 2, (3, 4), cands, "us") == []  # asked already
    assert d.peer_lost(1.0, 0, {1: cands[1]}, {2: "us"}) == [AskDonor(1, 2, (3, 4))]
    assert not d.delivered(2, 0)  # the lost donor's late answer is not taken
    assert d.tick(20.0, {0: cands[0], 1: cands[1]}, {2: "us"}) == [NoDonor(2, "donors [0, 1] went away")]
    assert d.replaced == 2 and d.pending == {}
    assert d.request(21.0, 2, (5, 5), {}, "us") == [NoDonor(2, "no healthy learner to copy from")]
    d.request(22.0, 2, (5, 5), cands, "us")
    assert d.delivered(2, 0) and d.served == 1 and d.pending == {}


def test_a_recipient_that_adopts_a_donor_and_replays_ends_bit_identical_to_the_syncer():
    syncer = SyncerCore(SyncerConfig(num_learners=3, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    syncer.run_id = "run-a"
    cfg = LearnerConfig(sync_every=4, num_fragments=2, tau=1, error_feedback=True)
    donor, recipient = LearnerCore(cfg, 0, FRAGS, PARAMS, CODEC), LearnerCore(cfg, 2, FRAGS, PARAMS, CODEC)
    for core in (donor, recipient):
        core.join("run-a", 1, 0, [(PARAMS, 0), (PARAMS, 0)], 0)
    for k in range(3):  # the donor follows a few merges: V = its versions now
        [b] = syncer.on_fragment(float(k), upload(1, fragment=k % 2, due=4 * (k + 1), base_version=syncer.version[k % 2]))
        donor.on_update(float(k), b.msg)
    donor.feedback.update(0, {"block_0/w": np.ones(3, np.float32)}, {"block_0/w": np.zeros(3, np.float32)})
    tensors, info = donor.export()
    # While the state travels, two more merges; the recipient buffers them and replays after adopting.
    buffered = []
    for k in range(3, 5):
        [b] = syncer.on_fragment(float(k), upload(1, fragment=k % 2, due=4 * (k + 1), base_version=syncer.version[k % 2]))
        buffered.append(b.msg)
    recipient.adopt(tensors, info)
    assert recipient.version == donor.version and recipient.step == donor.step
    assert np.array_equal(recipient.feedback.residual(0)["block_0/w"], np.ones(3, np.float32))
    for u in [*buffered, buffered[0]]:  # a duplicate in the replay is ignored
        recipient.on_update(9.0, u)
    assert recipient.version == syncer.version
    for p in range(2):
        assert all(recipient.base[p][n].tobytes() == syncer.theta[p][n].tobytes() for n in FRAGS[p])


def test_adopt_refuses_a_state_of_another_layout_or_incarnation_and_changes_nothing():
    cfg = LearnerConfig(sync_every=4, num_fragments=2, tau=1)
    donor, recipient = LearnerCore(cfg, 0, FRAGS, PARAMS, CODEC), LearnerCore(cfg, 1, FRAGS, PARAMS, CODEC)
    recipient.join("run-a", 2, 1, [(PARAMS, 0), (PARAMS, 0)], 0)
    donor.join("run-a", 2, 1, [(PARAMS, 3), (PARAMS, 3)], 0)
    tensors, info = donor.export()
    with pytest.raises(ProtocolError, match="incarnation 1"):
        recipient.adopt(tensors, {**info, "epoch": 1})
    with pytest.raises(ProtocolError, match="base/0/block_0/w"):
        recipient.adopt({**tensors, "base/0/block_0/w": np.zeros(7, np.float32)}, info)
    with pytest.raises(ProtocolError, match="residual 'x'"):
        recipient.adopt({**tensors, "feedback/x": np.zeros(1, np.float32)}, info)
    assert recipient.version == [0, 0]


# ---- the syncer's side of a donation: parts, digest, serving, taken ----------------------------

from wan_diloco.core.recovery import (  # noqa: E402
    DonatedState, NoState, PartRefused, RecoveryStarted, StateReady, StateTaken, state_digest,
)


def asked(max_state_bytes=None):
    d = Donations(timeout_s=10.0, max_state_bytes=max_state_bytes)
    cands = {0: Candidate("us", 8), 1: Candidate("eu", 8)}
    acts = d.on_metadata(0.0, 2, True, (3, 4), cands, "eu")
    assert acts == [RecoveryStarted(2), AskDonor(1, 2, (3, 4))]
    assert d.on_metadata(0.5, 2, True, (3, 4), cands, "eu") == []  # asked already
    return d


def test_parts_arrive_in_order_and_the_whole_is_checked_against_its_digest():
    d = asked()
    state = bytes(range(10))
    with pytest.raises(PartRefused, match="learner 0 was not asked"):
        d.on_part(1.0, 0, 2, 0, 10, state_digest(state), state[:4])
    with pytest.raises(PartRefused, match="first part never arrived"):
        d.on_part(1.0, 1, 2, 4, 10, state_digest(state), state[4:])
    assert d.on_part(1.0, 1, 2, 0, 10, state_digest(state), state[:4]) == []
    with pytest.raises(PartRefused, match="offset 6, but only 4 bytes"):
        d.on_part(1.0, 1, 2, 6, 10, state_digest(state), state[6:])
    assert d.on_part(2.0, 1, 2, 0, 10, state_digest(state), state[:4]) == []  # sent again: lands on itself
    assert d.not_yet(2) == NoState("peer state still arriving (4 of 10 bytes): ask again", waiting=True)
    assert d.on_part(3.0, 1, 2, 4, 10, state_digest(state), state[4:]) == [StateReady(2, 1, 10)]
    assert d.lookup(2) == DonatedState(state_digest(state), bytearray(state))
    assert d.served == 1 and d.received_bytes == 14 and not d.pending
    assert d.on_metadata(4.0, 2, False, (), {}, "eu") == [StateTaken(2)] and d.lookup(2) is None


def test_a_state_too_large_or_not_matching_its_digest_is_refused_and_never_served():
    d = asked(max_state_bytes=8)
    with pytest.raises(ProtocolError, match="a state of 10 bytes is larger than this model's state can be"):
        d.on_part(1.0, 1, 2, 0, 10, "0" * 16, b"x" * 10)
    d.max_state_bytes = None
    with pytest.raises(ProtocolError, match="does not match its digest"):
        d.on_part(1.0, 1, 2, 0, 3, "0" * 16, b"abc")
    assert d.lookup(2) is None and d.donor_of(2) == 1  # the donor is replaced when its time is up
    assert d.not_yet(5) == NoState("no peer state arrived in time", waiting=False)


def test_nobody_to_copy_from_is_the_answer_kept_for_the_recipient_and_a_lost_recipient_drops_it():
    d = Donations(timeout_s=10.0)
    assert d.on_metadata(0.0, 2, True, (0,), {}, "eu") == [RecoveryStarted(2), NoDonor(2, "no healthy learner to copy from")]
    assert d.lookup(2) == NoState("no peer state: no healthy learner to copy from", waiting=False)
    assert d.on_peer_lost(1.0, 2, {}, {}) == [StateTaken(2)] and d.lookup(2) is None


def test_candidates_are_live_trained_unquarantined_learners_not_recovering_themselves():
    class L:
        def __init__(self, alive, step):
            self.alive, self.step = alive, step

    d = asked()
    learners = {0: L(True, 5), 1: L(True, 5), 2: L(True, 0), 3: L(False, 9), 4: L(True, 3)}
    got = d.candidates(10.0, learners, {4: (20.0, "norm")}, {m: f"r{m}" for m in range(5)})
    assert got == {0: Candidate("r0", 5), 1: Candidate("r1", 5)}
