import json

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.tape import Outage, load_tape, merge_outages, parse_tape, save_tape, scale_tape


def test_round_trip(tmp_path):
    outages = [Outage(1, 5.0, 9.5), Outage(0, 0.0, 2.0), Outage(0, 3.0, 4.0)]
    path = tmp_path / "t.json"
    save_tape(path, outages)
    assert load_tape(path) == [Outage(0, 0.0, 2.0), Outage(0, 3.0, 4.0), Outage(1, 5.0, 9.5)]
    assert json.loads(path.read_text())[0] == {"learner": 0, "down_at": 0.0, "up_at": 2.0}


def test_overlapping_and_touching_outages_of_one_learner_merge():
    data = [
        {"learner": 0, "down_at": 0, "up_at": 5},
        {"learner": 0, "down_at": 2, "up_at": 3},  # inside the first
        {"learner": 0, "down_at": 5, "up_at": 7},  # touches it
        {"learner": 1, "down_at": 1, "up_at": 6},  # other learner: untouched
        {"learner": 0, "down_at": 10, "up_at": 11},
    ]
    assert parse_tape(data) == [Outage(0, 0.0, 7.0), Outage(1, 1.0, 6.0), Outage(0, 10.0, 11.0)]


@pytest.mark.parametrize(
    "entry, message",
    [
        ([1, 2, 3], "entry 1: must be an object"),
        ({"learner": 0, "down_at": 1}, "entry 1: missing key 'up_at'"),
        ({"learner": 0, "down_at": 1, "up_at": 2, "why": "x"}, "entry 1: unknown key 'why'"),
        ({"learner": -1, "down_at": 1, "up_at": 2}, r"entry 1\.learner: must be an integer >= 0"),
        ({"learner": True, "down_at": 1, "up_at": 2}, r"entry 1\.learner"),
        ({"learner": 0, "down_at": "1", "up_at": 2}, r"entry 1\.down_at: must be a finite number"),
        ({"learner": 0, "down_at": 1, "up_at": float("inf")}, r"entry 1\.up_at: must be a finite number"),
        ({"learner": 0, "down_at": -1, "up_at": 2}, r"entry 1\.down_at: must be >= 0"),
        ({"learner": 0, "down_at": 3, "up_at": 3}, r"entry 1\.up_at: must be later than down_at"),
    ],
)
def test_bad_entries_are_named(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_tape([{"learner": 0, "down_at": 0, "up_at": 1}, entry])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tape(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_tape(bad)
    bad.write_text('{"learner": 0}')
    with pytest.raises(ConfigError, match="must be a JSON list"):
        load_tape(bad)


def test_save_refuses_invalid_outages_without_writing(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ConfigError, match="up_at"):
        save_tape(path, [Outage(0, 5.0, 1.0)])
    assert not path.exists()


def test_scale_tape():
    scaled = scale_tape([Outage(2, 100.0, 400.0)], 0.01)
    assert scaled == [Outage(2, 1.0, 4.0)]
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="time_scale"):
            scale_tape([], bad)


def test_merge_keeps_learners_apart():
    merged = merge_outages([Outage(0, 0.0, 10.0), Outage(1, 2.0, 3.0)])
    assert len(merged) == 2
