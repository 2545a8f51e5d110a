"""Bytes in, messages out: the fp32 codec, the envelope and the core <-> transport mapping (no sockets)."""
import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.core import FragmentUpload, GlobalUpdate, ProtocolError
from wan_diloco.runtime import wire

LAYOUT = wire.Layout([("a", "b"), ("c",)], {"a": (2, 3), "b": (4,), "c": (5,)})


def values(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.normal(size=(2, 3)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}


def test_float32_roundtrip_is_exact_and_in_fragment_order():
    codec = wire.Float32Wire(LAYOUT)
    v = values()
    enc = codec.roundtrip({"b": v["b"], "a": v["a"]})  # dict order must not matter
    assert enc.nbytes == len(enc.payload) == 40
    assert enc.payload == v["a"].tobytes() + v["b"].tobytes()
    out = codec.decode(0, enc.payload)
    assert all(np.array_equal(out[n], v[n]) for n in v)


@pytest.mark.parametrize("payload, fragment, text", [
    (b"\0" * 36, 0, "36 bytes, expected 40"),
    (b"\0" * 40, 1, "40 bytes, expected 20"),
    (b"\0" * 40, 2, "out of range"),
    (np.full(10, np.nan, np.float32).tobytes(), 0, "NaN"),
])
def test_decode_refuses_wrong_shapes_and_nan(payload, fragment, text):
    with pytest.raises(ProtocolError, match=text):
        wire.Float32Wire(LAYOUT).decode(fragment, payload)


def test_encode_refuses_unknown_tensors_and_nan():
    codec = wire.Float32Wire(LAYOUT)
    with pytest.raises(ProtocolError, match="do not form fragment 0"):
        codec.roundtrip({"a": values()["a"]})
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        codec.roundtrip({**values(), "b": np.array([1, np.inf, 0, 0], np.float32)})


@pytest.mark.parametrize("payload, text", [
    (b"\1\0", "too short"),
    (b"\xff\xff\0\0{}", "does not fit"),
    (b"\3\0\0\0[1]", "JSON object"),
    (b"\2\0\0\0{}", "'due_step'"),
    (wire.seal({"due_step": "x", "final": True}, b""), "'due_step': expected int"),
])
def test_envelope_errors_name_the_problem(payload, text):
    with pytest.raises(ProtocolError, match=text):
        wire.unseal(payload, {"due_step": int, "final": bool})


def test_upload_and_update_survive_the_mapping():
    codec = wire.Float32Wire(LAYOUT)
    enc = codec.roundtrip(values(1))
    up = FragmentUpload(2, 0, 24, 3, 8, 1024, VectorClock({"learner-2": 5}), enc.values, enc.nbytes, enc.payload, "eu")
    back, fields = wire.upload_from_wire(wire.upload_to_wire(up, final=True, extra={"step_s": 0.5}), codec, 4)
    assert (back.learner, back.fragment, back.due_step, back.base_version, back.c_tokens, back.region) == (2, 0, 24, 3, 1024, "eu")
    assert back.clock == up.clock and fields["final"] is True and fields["step_s"] == 0.5
    assert all(np.array_equal(back.delta[n], up.delta[n]) for n in up.delta)
    with pytest.raises(ProtocolError, match="not a learner of this run"):
        wire.upload_from_wire(wire.upload_to_wire(up), codec, 2)

    g = GlobalUpdate(0, 4, 5, 24, 30, VectorClock({"syncer": 9}), enc.values, enc.nbytes, (1, 2), {1: 0.25}, enc.payload)
    got = wire.update_from_wire(wire.update_to_wire(g), codec)
    assert (got.from_version, got.to_version, got.due_step, got.global_step, got.contributors, dict(got.held_s)) == \
        (4, 5, 24, 30, (1, 2), {1: 0.25})
    assert all(np.array_equal(got.update[n], g.update[n]) for n in g.update)


def test_bulk_fragment_roundtrip():
    v = values(2)
    p, version, step, out = wire.fragment_from_bulk(wire.fragment_to_bulk(0, 7, v, LAYOUT, 99), LAYOUT)
    assert (p, version, step) == (0, 7, 99) and all(np.array_equal(out[n], v[n]) for n in v)
