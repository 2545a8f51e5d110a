"""The syncer's ledger of the learners' data positions."""
from wan_diloco.core.positions import Positions


def test_the_latest_position_per_learner_is_kept_and_handed_back():
    p = Positions(2, max_chars=8)
    p.on_metadata(0.0, 0, "a")
    p.on_metadata(1.0, 0, "")  # said nothing: the last one stands
    p.on_metadata(1.0, 1, "x" * 9)  # past the limit: not kept
    p.on_metadata(1.0, 5, "b")  # not a learner of this run
    assert p.of(0) == "a" and p.of(1) == "" and p.export() == {"0": "a"}


def test_restore_keeps_only_learners_of_this_run_within_the_limits():
    p = Positions(2, max_chars=4)
    p.restore({"0": "ok", "1": "toolong", "2": "x", "²": "y", "-1": "z", "1x": 3})
    assert p.by_learner == {0: "ok"}
    p.restore(["not", "a", "dict"])
    assert p.by_learner == {0: "ok"}
