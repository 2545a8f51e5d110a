"""core.final_sync: the learner's final sync, its rounds, fetches and verdict."""
import pytest

from wan_diloco.core import Rejoin
from wan_diloco.core.final_sync import FETCH_TRIES, FINAL_ROUNDS, Final, FinalSync


def test_each_round_fetches_every_final_fragment_and_the_rounds_are_bounded():
    fs = FinalSync(2, 3)
    for _ in range(FINAL_ROUNDS):
        assert fs.begin() == ["final/0", "final/1", "final/2"]
    with pytest.raises(ValueError, match=f"each of {FINAL_ROUNDS} final syncs"):
        fs.begin()


def test_a_failed_fetch_is_asked_again_until_the_last_try():
    fs = FinalSync(2, 3)
    said = fs.on_fetch_failed(1, 1, "CANCELLED")
    assert said.event["event"] == "warning" and f"final fragment 1 failed (try 1 of {FETCH_TRIES})" in said.event["what"]
    assert fs.on_fetch_failed(1, FETCH_TRIES, "CANCELLED") is None  # the failure ends the run


def test_finals_of_an_incarnation_it_has_not_joined_mean_rejoin_and_sync_again():
    fs = FinalSync(0, 2)
    same = [Final(0, 5, 2, 3), Final(1, 4, 2, 3)]
    assert fs.on_finals(2, same) == []
    assert fs.on_finals(1, same) == [Rejoin(2, 3)]  # the syncer resumed from snapshot 3 meanwhile


def test_what_the_broadcast_has_not_brought_is_installed_and_the_verdict_names_drifted_fragments():
    finals = [Final(0, 5, 1, 0), Final(1, 4, 1, 0), Final(2, 9, 1, 0)]
    assert FinalSync.behind([5, 3, 9], finals) == [1]
    assert FinalSync.behind([5, 4, 10], finals) == []
    assert FinalSync.verdict(["a", "b", "c"], ["a", "x", "c"]) == [1]
    assert FinalSync.verdict(["a", "b"], ["a", "b"]) == []
