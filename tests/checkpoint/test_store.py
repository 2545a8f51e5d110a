import json

import numpy as np
import pytest

from wan_diloco.checkpoint import CheckpointError, SnapshotStore, load_params, read_params, save_params


def _snapshot(store, s, value, complete=True):
    store.save_part(s, "syncer", {"theta": np.full(4, value, np.float32)}, {"merges": s}, "syncer")
    if complete:
        store.mark_complete(s, {"parts": ["syncer"], "run_id": "r"})


def test_newest_complete_snapshot_wins_and_incomplete_ones_are_ignored(tmp_path):
    st = SnapshotStore(tmp_path)
    _snapshot(st, 1, 1.0)
    _snapshot(st, 2, 2.0)
    _snapshot(st, 3, 3.0, complete=False)
    assert st.ids() == [1, 2, 3] and st.complete_ids() == [1, 2] and st.next_id() == 4
    s, tensors, info, manifest = st.newest("syncer", "syncer")
    assert (s, float(tensors["theta"][0]), info, manifest["run_id"]) == (2, 2.0, {"merges": 2}, "r")
    with pytest.raises(CheckpointError, match="incomplete"):
        st.manifest(3)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_corrupt_part_falls_back_to_the_previous_complete_snapshot(tmp_path, damage):
    st = SnapshotStore(tmp_path)
    _snapshot(st, 1, 1.0)
    _snapshot(st, 2, 2.0)
    part = st.part(2, "syncer")
    data = part.read_bytes()
    if damage == "truncate":
        part.write_bytes(data[: len(data) - 5])
    elif damage == "flip":
        part.write_bytes(data[:-1] + bytes([data[-1] ^ 0x10]))
    else:
        part.unlink()
    s, tensors, _, _ = st.newest("syncer", "syncer")
    assert s == 1 and float(tensors["theta"][0]) == 1.0
    assert st.skipped and st.skipped[0][0] == 2


def test_a_corrupt_manifest_makes_the_snapshot_incomplete(tmp_path):
    st = SnapshotStore(tmp_path)
    _snapshot(st, 1, 1.0)
    _snapshot(st, 2, 2.0)
    path = st.dir(2) / "COMPLETE.json"
    doc = json.loads(path.read_text())
    doc["run_id"] = "other"
    path.write_text(json.dumps(doc))
    assert st.complete_ids() == [1]
    assert st.newest("syncer", "syncer")[0] == 1


def test_no_snapshot_gives_none(tmp_path):
    assert SnapshotStore(tmp_path / "nothing").newest("syncer", "syncer") is None


def test_gc_keeps_the_newest_complete_and_anything_newer(tmp_path):
    st = SnapshotStore(tmp_path)
    for s in (1, 2, 3, 4):
        _snapshot(st, s, float(s), complete=s != 2)
    _snapshot(st, 5, 5.0, complete=False)  # in progress
    assert st.gc(keep=2) == [1, 2]
    assert st.ids() == [3, 4, 5]


def test_params_roundtrip_flat_and_into_a_template(tmp_path):
    like = {"block_0": {"kernel": np.zeros((2, 3), np.float32)}, "bias": np.zeros(3, np.float32)}
    values = {"block_0": {"kernel": np.ones((2, 3), np.float32)}, "bias": np.arange(3, dtype=np.float32)}
    save_params(tmp_path / "p.safetensors", values, {"run_id": "r"})
    flat, info = read_params(tmp_path / "p.safetensors")
    assert set(flat) == {"block_0/kernel", "bias"} and info == {"run_id": "r"}
    tree = load_params(tmp_path / "p.safetensors", like=like)
    assert set(load_params(tmp_path / "p.safetensors")) == set(flat)  # the parameters alone, no info
    assert np.array_equal(tree["block_0"]["kernel"], values["block_0"]["kernel"])
    with pytest.raises(CheckpointError, match="shape"):
        load_params(tmp_path / "p.safetensors", like={**like, "bias": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match="missing"):
        load_params(tmp_path / "p.safetensors", like={**like, "other": np.zeros(1, np.float32)})


def test_a_resume_takes_an_incomplete_snapshot_that_holds_a_learner_part_and_names_what_is_missing(tmp_path):
    # #23 case 9: learner 1 never wrote its part, so no snapshot was ever complete; learner 0's part is there
    # (learner 1 recovers from it). Snapshot 3, cut as the run stopped, has no learner part at all.
    st = SnapshotStore(tmp_path)
    _snapshot(st, 1, 1.0)
    _snapshot(st, 2, 2.0, complete=False)
    st.save_part(2, "learner-0", {"opt": np.zeros(2, np.float32)}, {}, "learner")
    _snapshot(st, 3, 3.0, complete=False)
    s, tensors, _, manifest = st.resumable("syncer", "syncer", learners=2)
    assert (s, float(tensors["theta"][0]), manifest) == (2, 2.0, None)
    assert st.missing(2, 2) == ["learner-1"] and st.parts_present(2) == ["learner-0", "syncer"]
    assert st.skipped == [(3, "incomplete and without a learner part (learner-0, learner-1 missing)")]
    # A complete snapshot newer than an incomplete one is taken; with only syncer parts, the newest of those.
    st.mark_complete(3, {"parts": ["syncer"], "run_id": "r"})
    assert st.resumable("syncer", "syncer", 2)[0] == 3
    only = SnapshotStore(tmp_path / "only")
    _snapshot(only, 4, 4.0, complete=False)
    assert only.resumable("syncer", "syncer", 2)[0] == 4
    assert SnapshotStore(tmp_path / "none").resumable("syncer", "syncer", 2) is None


def test_the_incarnation_record_reads_back_and_a_damaged_one_is_named(tmp_path):
    st = SnapshotStore(tmp_path)
    assert st.incarnation_seen() == 0  # no resume yet
    st.record_incarnation(3, "r")
    assert st.incarnation_seen() == 3 and SnapshotStore(tmp_path).incarnation_seen() == 3
    assert st.ids() == [] and st.fork_refusal() is None  # not a snapshot
    path = tmp_path / "INCARNATION.json"
    for body, why in [(b'{"epoch": 3', "unreadable"), (b'{"epoch": 0}', "epoch = 0"), (b'[3]', "epoch = None"),
                      (b'{"epoch": "3"}', "epoch = '3'")]:
        path.write_bytes(body)
        with pytest.raises(CheckpointError, match=f"INCARNATION.json: .*{why}"):
            st.incarnation_seen()
