import json
import struct

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from wan_diloco.transport.messages import (
    MAX_HEADER_BYTES, MAX_META_DEPTH, PRELUDE, WIRE_VERSION, Ack, BulkChunk, BulkRequest, Frame,
    MessageError, OversizedError, Subscribe, decode_message, encode_message,
)

CLOCK = {"learner-0": 12, "learner-1": 9, "syncer": 4}
META = {"step": 12, "c_steps": [3, 0, 7], "clock": CLOCK, "step_s": 0.25, "sync_s": None, "final": False,
        "region": "us-east", "held_s": {"1": 0.5}, "nested": [{"a": [1, -2, 3.5]}]}
EXAMPLES = [
    Frame("learner-0", 0, META),
    Frame("learner-0", 2, META, bytes(range(256)) * 3),
    Frame("syncer", 2, {}, b"\x00\xff" * 500),
    Subscribe("learner-1", "eu-west", "0123abcd"),
    BulkRequest("learner-1", "global", CLOCK),
    BulkChunk("syncer", "global", 3, 3 << 20, 10 << 20, b"x" * 1000),
    Ack("syncer", 40, "merged"),
    BulkRequest("learner-1", "donation/1", {}, offset=(1 << 63) - 1, etag="v7:ab12"),  # a resume
    BulkChunk("syncer", "donation/1", 0, 5 << 20, 10 << 20, b"y" * 10, etag="v7:ab12"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_roundtrip_every_kind(msg):
    data = encode_message(msg)
    back = decode_message(data)
    assert type(back) is type(msg)
    assert back == msg
    if hasattr(msg, "payload"):
        assert bytes(back.payload) == bytes(msg.payload)


def test_payload_is_a_zero_copy_readonly_view():
    data = bytearray(encode_message(EXAMPLES[1]))
    msg = decode_message(data)
    assert isinstance(msg.payload, memoryview) and msg.payload.readonly
    assert msg.payload.obj is data


def _rebuild(data: bytes, **changes) -> bytes:
    """Re-pack a message with prelude fields changed and a correct checksum."""
    magic, version, kind, flags, hlen, plen = PRELUDE.unpack_from(data)
    fields = dict(magic=magic, version=version, kind=kind, flags=flags, hlen=hlen, plen=plen)
    body = changes.pop("body", data[PRELUDE.size : -8])
    fields.update(changes)
    head = PRELUDE.pack(fields["magic"], fields["version"], fields["kind"], fields["flags"],
                        fields["hlen"], fields["plen"])
    return head + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + body))


def _with_header(msg, header: dict, payload: bytes = b"") -> bytes:
    body = json.dumps(header).encode() + payload
    return _rebuild(encode_message(msg), body=body, hlen=len(body) - len(payload), plen=len(payload))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d[:10], "truncated"),
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: _rebuild(d, version=WIRE_VERSION + 1), f"unsupported wire version {WIRE_VERSION + 1}"),
    (lambda d: _rebuild(d, version=1), "unsupported wire version 1; this build speaks version 6"),
    (lambda d: _rebuild(d, kind=99), "unknown message kind 99"),
    (lambda d: _rebuild(d, flags=1), "unknown flags"),
    (lambda d: d + b"\x00", "length mismatch"),
    (lambda d: d[:-1], "length mismatch"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "checksum mismatch"),
    (lambda d: _rebuild(d, hlen=(1 << 20) + 1), "header length"),
])
def test_refuses_malformed_prelude(mutate, match):
    data = encode_message(EXAMPLES[1])
    with pytest.raises(MessageError, match=match):
        decode_message(mutate(data))


def test_refuses_oversized_before_parsing():
    data = encode_message(EXAMPLES[1])
    with pytest.raises(OversizedError, match=f"{len(data)} bytes, limit 100"):
        decode_message(data, max_bytes=100)


def frame_header(**changes):
    return {"sender": "a", "fragment": 1, "meta": {"x": 1}, **changes}


@pytest.mark.parametrize("header, match", [
    ({"sender": "a", "fragment": 1}, r"missing \['meta'\]"),
    (frame_header(x=1), r"unknown \['x'\]"),
    (frame_header(fragment=-1), r"Frame.fragment: must be in \[0, 2\*\*63\)"),
    (frame_header(fragment=True), "Frame.fragment: must be an integer"),
    (frame_header(fragment=1.0), "Frame.fragment: must be an integer"),
    (frame_header(sender=""), "Frame.sender: must not be empty"),
    (frame_header(sender=7), "Frame.sender: must be a string"),
    (frame_header(sender="s" * 257), "Frame.sender: longer than 256"),
    (["not", "an", "object"], "header must be a JSON object"),
])
def test_refuses_bad_header_fields(header, match):
    with pytest.raises(MessageError, match=match):
        decode_message(_with_header(EXAMPLES[0], header))


def nested(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("meta, match", [
    ([1, 2], "Frame.meta: must be a JSON object, got list"),
    ("text", "Frame.meta: must be a JSON object, got str"),
    (None, "Frame.meta: must be a JSON object, got NoneType"),
    ({"deep": nested(MAX_META_DEPTH)}, "nested deeper than 16"),
    ({"big": 1 << 63}, r"Frame.meta\['big'\]: integer .* outside int64"),
    ({"k" * 257: 1}, "key longer than 256"),
])
def test_refuses_bad_meta_on_decode(meta, match):
    with pytest.raises(MessageError, match=match):
        decode_message(_with_header(EXAMPLES[0], frame_header(meta=meta)))


@pytest.mark.parametrize("text, match", [
    (b'{"x":NaN}', "not valid UTF-8 JSON"),
    (b'{"x":Infinity}', "not valid UTF-8 JSON"),
    (b'{"x":1e999}', r"Frame.meta\['x'\]: inf is not a finite number"),
])
def test_refuses_non_finite_numbers_in_meta(text, match):
    body = b'{"sender":"a","fragment":0,"meta":' + text + b"}"
    with pytest.raises(MessageError, match=match):
        decode_message(_rebuild(encode_message(EXAMPLES[0]), body=body, hlen=len(body), plen=0))


def test_meta_round_trips_as_json_types():
    meta = {"t": (1, 2), "n": None, "b": True, "f": -0.5, "s": "ünïcode", "o": {"k": [(3,)]}, "i": -(1 << 63)}
    back = decode_message(encode_message(Frame("a", 0, meta)))
    assert back.meta == {"t": [1, 2], "n": None, "b": True, "f": -0.5, "s": "ünïcode", "o": {"k": [[3]]},
                         "i": -(1 << 63)}
    assert type(back.meta["b"]) is bool and type(back.meta["f"]) is float


def test_meta_deep_exactly_at_the_limit_is_fine():
    meta = {"deep": nested(MAX_META_DEPTH - 1)}
    assert decode_message(encode_message(Frame("a", 0, meta))).meta == meta


@pytest.mark.parametrize("meta, match", [
    ({1: "x"}, r"Frame.meta: keys must be strings, got 1"),
    ({"x": b"bytes"}, r"Frame.meta\['x'\]: bytes is not a JSON value"),
    ({"x": {1, 2}}, r"Frame.meta\['x'\]: set is not a JSON value"),
    ({"x": [1, float("nan")]}, r"Frame.meta\['x'\]\[1\]: nan is not a finite number"),
    ({"x": float("-inf")}, "not a finite number"),
    ({"x": -(1 << 63) - 1}, "outside int64"),
    ({"x": nested(MAX_META_DEPTH)}, "nested deeper than 16"),
    ({"x": "\ud800"}, "not valid Unicode"),
    ({"x": "y" * MAX_HEADER_BYTES}, f"Frame: header is {MAX_HEADER_BYTES + 43} bytes, limit {MAX_HEADER_BYTES}"),
    (["x"], "Frame.meta: must be a JSON object"),
])
def test_encode_refuses_bad_meta(meta, match):
    with pytest.raises(MessageError, match=match):
        encode_message(Frame("a", 0, meta))


def test_decoded_meta_is_a_fresh_copy():
    meta = {"a": [1, 2]}
    frame = Frame("a", 0, meta)
    data = encode_message(frame)
    meta["a"].append(3)  # the caller changing its dict after encoding changes nothing sent
    assert decode_message(data).meta == {"a": [1, 2]}


def test_refuses_non_json_header_and_stray_payload():
    data = encode_message(EXAMPLES[3])
    body = b"\xff\xfe not json"
    with pytest.raises(MessageError, match="not valid UTF-8 JSON"):
        decode_message(_rebuild(data, body=body, hlen=len(body), plen=0))
    header = json.loads(data[PRELUDE.size : -8])
    with pytest.raises(MessageError, match="carries no payload, got 3 bytes"):
        decode_message(_with_header(EXAMPLES[3], header, payload=b"abc"))


def test_subscribe_must_name_its_instance_and_version_2_is_refused():
    data = encode_message(EXAMPLES[3])
    header = json.loads(data[PRELUDE.size : -8])
    assert header == {"sender": "learner-1", "region": "eu-west", "instance": "0123abcd"}
    version_2 = {"sender": "learner-1", "region": "eu-west"}  # what a build before the instance id sends
    with pytest.raises(MessageError, match=r"Subscribe: header fields missing \['instance'\]"):
        decode_message(_with_header(EXAMPLES[3], version_2))
    with pytest.raises(MessageError, match="unsupported wire version 2; this build speaks version 6"):
        decode_message(_rebuild(_with_header(EXAMPLES[3], version_2), version=2))
    with pytest.raises(MessageError, match="Subscribe.instance: must not be empty"):
        decode_message(_with_header(EXAMPLES[3], {**header, "instance": ""}))
    with pytest.raises(MessageError, match="Subscribe.instance: must not be empty"):
        encode_message(Subscribe("learner-1", "eu-west", ""))


def bulk_request_header(**changes):
    return {"sender": "a", "name": "global", "clock": {}, "offset": 0, "etag": "", **changes}


@pytest.mark.parametrize("header, match", [
    (bulk_request_header(offset=-1), r"BulkRequest.offset: must be in \[0, 2\*\*63\)"),
    (bulk_request_header(offset=1 << 63), r"BulkRequest.offset: must be in \[0, 2\*\*63\)"),
    (bulk_request_header(offset=1.0), "BulkRequest.offset: must be an integer, got float"),
    (bulk_request_header(offset="5"), "BulkRequest.offset: must be an integer, got str"),
    (bulk_request_header(offset=True), "BulkRequest.offset: must be an integer, got bool"),
    (bulk_request_header(offset=None), "BulkRequest.offset: must be an integer, got NoneType"),
    (bulk_request_header(etag=7), "BulkRequest.etag: must be a string, got int"),
    (bulk_request_header(etag="e" * 257), "BulkRequest.etag: longer than 256"),
    ({k: v for k, v in bulk_request_header().items() if k != "etag"}, r"missing \['etag'\]"),
    ({"sender": "a", "name": "global", "clock": {}}, r"missing \['etag', 'offset'\]"),  # a version 3 request
])
def test_refuses_bad_bulk_request_fields(header, match):
    with pytest.raises(MessageError, match=match):
        decode_message(_with_header(EXAMPLES[4], header))


def test_bulk_etag_limits_on_encode_and_decode():
    assert decode_message(encode_message(BulkRequest("a", "g", {}, 3, "e" * 256))).etag == "e" * 256
    with pytest.raises(MessageError, match="BulkChunk.etag: longer than 256"):
        encode_message(BulkChunk("s", "g", 0, 0, 1, b"x", "e" * 257))
    with pytest.raises(MessageError, match="BulkRequest.offset: must be in"):
        encode_message(BulkRequest("a", "g", {}, -1, "v1"))
    with pytest.raises(MessageError, match="not valid Unicode"):
        encode_message(BulkRequest("a", "g", {}, 3, "\ud800"))
    chunk = json.loads(encode_message(EXAMPLES[5])[PRELUDE.size : -8 - 1000])
    with pytest.raises(MessageError, match="BulkChunk.etag: must be a string, got list"):
        decode_message(_with_header(EXAMPLES[5], {**chunk, "etag": ["v1"]}, payload=b"x" * 1000))
    body = b'{"sender":"a","name":"global","clock":{},"offset":3,"etag":"\\udc00"}'  # a lone surrogate
    with pytest.raises(MessageError, match="not valid Unicode"):
        decode_message(_rebuild(encode_message(EXAMPLES[4]), body=body, hlen=len(body), plen=0))


def test_encode_refuses_invalid_fields():
    with pytest.raises(MessageError, match="Frame.fragment: must be an integer"):
        encode_message(Frame("a", "1", {}, b""))
    with pytest.raises(MessageError, match="Frame.payload: must be bytes-like"):
        encode_message(Frame("a", 1, {}, "text"))
    with pytest.raises(MessageError, match="Subscribe.sender: must not be empty"):
        encode_message(Subscribe("", "r", "i"))
    with pytest.raises(MessageError, match="not a message type"):
        encode_message({"sender": "a"})


names = st.text(min_size=1, max_size=20)
ints = st.integers(0, 2**63 - 1)
clocks = st.dictionaries(names, ints, max_size=5)
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
metas = st.dictionaries(st.text(max_size=20), st.recursive(
    json_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20), max_size=6)
messages = st.one_of(
    st.builds(Frame, names, ints, metas, st.binary(max_size=300)),
    st.builds(Subscribe, names, names, names),
    st.builds(BulkRequest, names, names, clocks, ints, st.text(max_size=20)),
    st.builds(BulkChunk, names, names, ints, ints, ints, st.binary(max_size=300), st.text(max_size=20)),
    st.builds(Ack, names, ints, st.text(max_size=30)),
)


@settings(max_examples=200, deadline=None)
@given(messages)
def test_fuzz_roundtrip(msg):
    assert decode_message(encode_message(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_only_raise_message_error(data):
    with pytest.raises(MessageError):
        decode_message(data)


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_fuzz_corrupted_messages_only_raise_message_error(msg, data):
    raw = bytearray(encode_message(msg))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "reprefix"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=20))
    else:  # a valid-looking prelude in front of junk, checksum recomputed to pass
        junk = data.draw(st.binary(max_size=60))
        raw = bytearray(_rebuild(bytes(raw), body=junk, hlen=len(junk), plen=0))
    try:
        decode_message(bytes(raw))
    except MessageError:
        pass  # the only allowed failure; anything else fails the test
