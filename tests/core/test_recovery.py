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
