"""core.peer: peer recovery on the learner's side, as a recipient and as a donor."""
import json

import pytest

from wan_diloco.core.peer import (
    AskAgain, Donor, PeerRequest, SendState, peer_wait_s, position_field, position_from_bytes,
)


def test_a_recipient_asks_again_while_nobody_is_healthy_within_its_patience_and_while_the_state_arrives():
    assert peer_wait_s(donor_timeout_s=10.0, call_timeout_s=5.0, upload_s=2.0) == 29.0
    req = PeerRequest(100.0, patience_s=30.0, wait_s=60.0)
    assert req.wait_s(110.0) == 50.0 and req.wait_s(200.0) == 0.0
    assert req.on_refused(110.0, "no healthy learner to copy from") == AskAgain(1.0, resend_metadata=True)
    assert req.on_refused(131.0, "no healthy learner to copy from") is None  # patience spent
    assert req.on_refused(150.0, "peer state still arriving (3 of 8 parts): ask again") == AskAgain(0.0, False)
    assert req.on_refused(161.0, "peer state still arriving (3 of 8 parts): ask again") is None  # deadline
    assert req.on_refused(101.0, "donors [0, 2] went away") is None  # any other answer ends the request
    assert PeerRequest(0.0, 0.0, 60.0).on_refused(1.0, "no healthy learner to copy from") is None  # no patience


def test_a_donor_serves_a_recipient_once_it_has_seen_the_versions_the_recipient_saw():
    donor = Donor(0)
    assert donor.on_donate(0.0, 0, (1, 1)) == [] and donor.asked == {}  # never for itself
    donor.on_donate(0.0, 2, (3, 5))
    donor.on_donate(0.0, 3, (1, 1))
    assert donor.on_versions(1.0, [3, 4]) == [SendState(3, (1, 1))]  # 2 saw fragment 1 at 5: wait
    assert donor.on_versions(2.0, [3, 4]) == []  # sent once
    assert donor.on_versions(3.0, [4, 5]) == [SendState(2, (3, 5))] and donor.asked == {}
    donor.on_donate(4.0, 2, (3,))
    assert donor.on_versions(5.0, [9, 9]) == []  # versions of another layout: never served


def test_the_data_position_the_syncer_kept_round_trips_and_an_unusable_one_is_refused():
    position = {"learner": 1, "batches": 12, "rng": {"state": 7}}
    text = position_field(position, max_chars=256)
    assert json.loads(text) == position and position_from_bytes(text.encode()) == position
    assert position_field(None, 256) == ""  # not known yet: the syncer keeps the one it has
    assert position_field({"rng": "x" * 300}, 256) == ""  # too long for the field: lost, not cut
    assert position_from_bytes(b"") is None
    with pytest.raises(ValueError):
        position_from_bytes(b"[1, 2]")
    with pytest.raises(ValueError):
        position_from_bytes(b"\xff")
