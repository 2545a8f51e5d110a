import os
import struct

import numpy as np
import pytest

from wan_diloco.checkpoint import CheckpointError, decode_state, encode_state, load_state, save_state, write_atomic
from wan_diloco.checkpoint.format import FORMAT_VERSION

T = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "count": np.array(7, np.int32), "e": np.zeros(0, np.float32)}
INFO = {"step": 42, "clock": {"learner-0": 3}, "rng": {"state": 2**100 + 3}}


def test_roundtrip_keeps_tensors_dtypes_and_info(tmp_path):
    size = save_state(tmp_path / "a.safetensors", T, INFO, "learner")
    assert size == (tmp_path / "a.safetensors").stat().st_size
    got, info = load_state(tmp_path / "a.safetensors", "learner")
    assert info == INFO
    assert set(got) == set(T)
    for n in T:
        assert got[n].dtype == T[n].dtype and np.array_equal(got[n], T[n])


def test_standard_safetensors_readers_read_it(tmp_path):
    from safetensors.numpy import load_file

    save_state(tmp_path / "a.safetensors", T, INFO, "params")
    assert np.array_equal(load_file(tmp_path / "a.safetensors")["w"], T["w"])


def test_wrong_kind_missing_file_and_other_formats_are_refused(tmp_path):
    from safetensors.numpy import save

    data = encode_state(T, INFO, "syncer")
    with pytest.raises(CheckpointError, match="holds 'syncer', expected 'learner'"):
        decode_state(data, "learner")
    with pytest.raises(CheckpointError, match="No such file"):
        load_state(tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="not a wan-diloco state file"):
        decode_state(save({"w": T["w"]}))
    newer = data.replace(f'"format_version":"{FORMAT_VERSION}"'.encode(), b'"format_version":"9"')
    with pytest.raises(CheckpointError, match="format version '9'"):
        decode_state(newer)


def test_every_single_bit_flip_in_data_or_metadata_is_detected():
    data = encode_state({"w": T["w"]}, {"step": 1}, "learner")
    (hlen,) = struct.unpack_from("<Q", data)
    for i in list(range(8 + hlen - 40, len(data))):  # the tail of the header (metadata) and every data byte
        for bit in (0, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            try:
                tensors, info = decode_state(bytes(bad))
            except CheckpointError:
                continue
            # A flip that leaves a valid file must be harmless (e.g. JSON whitespace): same content.
            assert info == {"step": 1} and np.array_equal(tensors["w"], T["w"]), f"byte {i} bit {bit}"


def test_truncations_are_detected():
    data = encode_state(T, INFO, "learner")
    for n in (0, 3, 8, 9, 50, len(data) // 2, len(data) - 1):
        with pytest.raises(CheckpointError):
            decode_state(data[:n])


def test_fuzz_random_mutations_only_raise_checkpoint_error():
    rng = np.random.default_rng(0)
    data = encode_state(T, INFO, "learner")
    for _ in range(10_000):
        bad = bytearray(data)
        kind = rng.integers(4)
        if kind == 0:
            for i in rng.integers(0, len(bad), size=rng.integers(1, 4)):
                bad[i] = rng.integers(256)
        elif kind == 1:
            bad = bad[: rng.integers(0, len(bad))]
        elif kind == 2:
            i = rng.integers(0, len(bad))
            bad[i:i] = rng.bytes(rng.integers(1, 16))
        else:
            bad[:8] = struct.pack("<Q", int(rng.integers(0, 2**63)))
        try:
            tensors, info = decode_state(bytes(bad))
        except CheckpointError:
            continue
        assert info == INFO and set(tensors) == set(T)


def test_nan_in_info_and_unstorable_dtypes_are_refused():
    with pytest.raises(ValueError):
        encode_state(T, {"x": float("nan")}, "learner")
    with pytest.raises(CheckpointError, match="complex64"):
        encode_state({"z": np.zeros(2, np.complex64)}, {}, "learner")


def test_write_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "f"
    write_atomic(path, b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temp file left behind
