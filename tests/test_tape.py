import json

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.tape import Outage, SyncerOutage, learner_outages, load_tape, merge_outages, parse_tape, save_tape, scale_tape


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


def test_syncer_and_shard_kills_round_trip_beside_learner_outages(tmp_path):
    tape = [Outage(2, 0.0, 3.0), SyncerOutage(4.0, 6.0), SyncerOutage(5.0, 7.0, shard=1), Outage(0, 1.0, 2.0)]
    path = tmp_path / "t.json"
    save_tape(path, tape)
    assert load_tape(path) == [Outage(2, 0.0, 3.0), Outage(0, 1.0, 2.0), SyncerOutage(4.0, 6.0),
                               SyncerOutage(5.0, 7.0, shard=1)]
    entries = json.loads(path.read_text())
    assert entries[0] == {"learner": 2, "down_at": 0.0, "up_at": 3.0}  # as older tapes: no "kind"
    assert entries[2] == {"kind": "kill_syncer", "down_at": 4.0, "up_at": 6.0}
    assert entries[3] == {"kind": "kill_syncer", "shard": 1, "down_at": 5.0, "up_at": 7.0}
    assert load_tape(path)[0].joins_late and not load_tape(path)[1].joins_late
    assert learner_outages(load_tape(path)) == [Outage(2, 0.0, 3.0), Outage(0, 1.0, 2.0)]
    assert parse_tape([{"kind": "kill_learner", "learner": 1, "down_at": 1, "up_at": 2}]) == [Outage(1, 1.0, 2.0)]


def test_outages_of_the_syncer_merge_apart_from_its_shards_and_scale():
    merged = parse_tape([{"kind": "kill_syncer", "down_at": 1, "up_at": 3},
                         {"kind": "kill_syncer", "down_at": 2, "up_at": 4},
                         {"kind": "kill_syncer", "shard": 0, "down_at": 2, "up_at": 5}])
    assert merged == [SyncerOutage(1.0, 4.0), SyncerOutage(2.0, 5.0, shard=0)]
    assert scale_tape(merged, 2.0) == [SyncerOutage(2.0, 8.0), SyncerOutage(4.0, 10.0, shard=0)]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"kind": "kill_shard", "down_at": 1, "up_at": 2}, r"entry 0\.kind: unknown kind 'kill_shard'"),
        ({"kind": "kill_syncer", "learner": 0, "down_at": 1, "up_at": 2}, "entry 0: unknown key 'learner'"),
        ({"kind": "kill_syncer", "up_at": 2}, "entry 0: missing key 'down_at'"),
        ({"kind": "kill_syncer", "shard": -1, "down_at": 1, "up_at": 2}, r"entry 0\.shard: must be an integer >= 0"),
        ({"kind": "kill_syncer", "shard": 1.0, "down_at": 1, "up_at": 2}, r"entry 0\.shard"),
        ({"kind": "kill_syncer", "down_at": 2, "up_at": 1}, r"entry 0\.up_at: must be later"),
        ({"kind": "kill_learner", "shard": 0, "down_at": 1, "up_at": 2}, "entry 0: missing key 'learner'"),
    ],
)
def test_bad_syncer_entries_are_named(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_tape([entry])


def test_the_planning_name_still_imports():
    from wan_diloco.planning import tape as old

    assert old.Outage is Outage and old.load_tape is load_tape


def test_the_chaos_harness_reads_the_syncer_kills_of_a_tape_by_the_same_name():
    from wan_diloco.runtime import chaos

    faults = chaos.from_tape([Outage(3, 1.0, 2.0), SyncerOutage(4.0, 9.0)], scale=1.0, learners=2)
    assert [(f.kind, f.target, f.t_s, f.hold_s) for f in faults] == [
        ("kill_learner", "learner-1", 1.0, 1.0), ("kill_syncer", "syncer", 4.0, 5.0)]
    with pytest.raises(ConfigError, match="shard"):
        chaos.from_tape([SyncerOutage(4.0, 9.0, shard=1)], scale=1.0, learners=2)
