import json
import struct

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from wan_diloco.transport.messages import (
    PRELUDE, WIRE_VERSION, Ack, BulkChunk, BulkRequest, FragmentUpload, GlobalUpdate,
    MessageError, Metadata, OversizedError, Subscribe, decode_message, encode_message,
)

CLOCK = {"learner-0": 12, "learner-1": 9, "syncer": 4}
EXAMPLES = [
    Metadata("learner-0", "us-east", 12, (3, 0, 7), (3072, 0, 7168), CLOCK),
    FragmentUpload("learner-0", "us-east", 2, 5, 24, 24576, CLOCK, bytes(range(256)) * 3),
    GlobalUpdate("syncer", 2, 6, 40, CLOCK, b"\x00\xff" * 500),
    Subscribe("learner-1", "eu-west"),
    BulkRequest("learner-1", "global", CLOCK),
    BulkChunk("syncer", "global", 3, 3 << 20, 10 << 20, b"x" * 1000),
    Ack("syncer", 40, "merged"),
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
    (lambda d: _rebuild(d, version=WIRE_VERSION + 1), "unsupported wire version 2"),
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


@pytest.mark.parametrize("header, match", [
    ({"sender": "a", "region": "r", "step": 1, "fragment_steps": [1], "fragment_tokens": [1]}, r"missing \['clock'\]"),
    ({"sender": "a", "region": "r", "step": 1, "fragment_steps": [1], "fragment_tokens": [1], "clock": {}, "x": 1},
     r"unknown \['x'\]"),
    ({"sender": "a", "region": "r", "step": -1, "fragment_steps": [], "fragment_tokens": [], "clock": {}},
     r"Metadata.step: must be in \[0, 2\*\*63\)"),
    ({"sender": "a", "region": "r", "step": True, "fragment_steps": [], "fragment_tokens": [], "clock": {}},
     "Metadata.step: must be an integer"),
    ({"sender": "a", "region": "r", "step": 1, "fragment_steps": [1, "2"], "fragment_tokens": [], "clock": {}},
     r"Metadata.fragment_steps\[1\]: must be an integer"),
    ({"sender": "a", "region": "r", "step": 1, "fragment_steps": [], "fragment_tokens": [], "clock": {"w": 1.5}},
     "Metadata.clock"),
    ({"sender": "a", "region": "r", "step": 1, "fragment_steps": [], "fragment_tokens": [], "clock": []},
     "Metadata.clock: must be a mapping"),
    ({"sender": "", "region": "r", "step": 1, "fragment_steps": [], "fragment_tokens": [], "clock": {}},
     "Metadata.sender: must not be empty"),
    (["not", "an", "object"], "header must be a JSON object"),
])
def test_refuses_bad_header_fields(header, match):
    with pytest.raises(MessageError, match=match):
        decode_message(_with_header(EXAMPLES[0], header))


def test_refuses_non_json_header_and_stray_payload():
    data = encode_message(EXAMPLES[0])
    body = b"\xff\xfe not json"
    with pytest.raises(MessageError, match="not valid UTF-8 JSON"):
        decode_message(_rebuild(data, body=body, hlen=len(body), plen=0))
    header = json.loads(data[PRELUDE.size : -8])
    with pytest.raises(MessageError, match="carries no payload, got 3 bytes"):
        decode_message(_with_header(EXAMPLES[0], header, payload=b"abc"))


def test_encode_refuses_invalid_fields():
    with pytest.raises(MessageError, match="FragmentUpload.fragment: must be an integer"):
        encode_message(FragmentUpload("a", "r", "1", 0, 0, 0, {}, b""))
    with pytest.raises(MessageError, match="FragmentUpload.payload: must be bytes-like"):
        encode_message(FragmentUpload("a", "r", 1, 0, 0, 0, {}, "text"))
    with pytest.raises(MessageError, match="Subscribe.sender: must not be empty"):
        encode_message(Subscribe("", "r"))
    with pytest.raises(MessageError, match="not a message type"):
        encode_message({"sender": "a"})


names = st.text(min_size=1, max_size=20)
ints = st.integers(0, 2**63 - 1)
clocks = st.dictionaries(names, ints, max_size=5)
messages = st.one_of(
    st.builds(Metadata, names, names, ints, st.tuples(ints, ints), st.tuples(ints, ints), clocks),
    st.builds(FragmentUpload, names, names, ints, ints, ints, ints, clocks, st.binary(max_size=300)),
    st.builds(GlobalUpdate, names, ints, ints, ints, clocks, st.binary(max_size=300)),
    st.builds(BulkChunk, names, names, ints, ints, ints, st.binary(max_size=300)),
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
