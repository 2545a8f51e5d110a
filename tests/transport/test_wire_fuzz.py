"""Fuzz the transport's wire decoders: ``decode_message`` and ``MessageReader.feed`` (#13).

Seeded loops over a numpy RNG (12,000 cases per decoder, a few seconds; hypothesis
costs ~10x more per case): random bytes, forged preludes with huge lengths,
truncations, byte-level mutations of valid encodings of every message kind, and
header mutations resealed with correct lengths and checksum so that they reach
the JSON parser and the field checks instead of stopping at the checksum.

Properties: only MessageError (OversizedError is one) escapes; whatever decodes
encodes again and decodes to the same message; and the reader, fed the same
bytes cut at random places, agrees with ``decode_message`` message by message.
A failure names the case, how it was made and the input bytes, to replay it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct

import numpy as np
import pytest
import xxhash

from wan_diloco.transport.framing import BufferPool, MessageReader
from wan_diloco.transport.messages import (
    MAX_INT, MAX_MESSAGE_BYTES, MAX_META_DEPTH, MAX_NAME_CHARS, MESSAGE_MAGIC, MESSAGE_TYPES, PRELUDE, PRELUDE_BYTES,
    TRAILER, TRAILER_BYTES, WIRE_VERSION,
    Ack, BulkChunk, BulkRequest, Frame, MessageError, Subscribe, decode_message, encode_message, message_length,
)

CASES = 12_000

SEEDS = [
    Frame("learner-0", 0, {}),
    Frame("learner-3", 7, {"step": 12, "clock": {"learner-3": 5, "syncer": 2}, "f": -0.5, "ok": True, "no": None,
                           "nested": [1, [2, {"x": "y"}]], "text": "ü€𝄞"}, bytes(range(256)) * 2),
    Frame("syncer", (1 << 63) - 1, {"lo": -(1 << 63), "hi": (1 << 63) - 1, "tiny": 5e-324}, bytes(40)),
    Frame("learner-1", 1, {"k": "v"}, np.random.default_rng(1).bytes(6000)),  # spans chunks: pooled buffers
    Subscribe("learner-1", "eu-west", "f3a9c0"),
    Subscribe("learner-0", "", "i"),
    BulkRequest("learner-2", "fragment/1", {"learner-2": 5, "syncer": 3}),
    BulkRequest("x", "final/0", {}),
    BulkChunk("syncer", "final/0", 2, 1024, 4096, bytes(range(200))),
    BulkChunk("syncer", "fragment/0", 0, 0, 0, b""),
    BulkRequest("learner-1", "donation/1", {}, 1 << 20, "v3:9f86d081"),  # resuming a broken transfer
    BulkChunk("syncer", "donation/1", 0, 1 << 20, 3 << 20, bytes(100), "v3:9f86d081"),
    Ack("syncer"),
    Ack("syncer", 7, "v3 — ok"),
]
ENCODED = [encode_message(m) for m in SEEDS]
INTERESTING = [0, 1, 2, 7, 8, 19, 20, 21, 28, 127, 128, 255, 256, 4095, 65535, 65536, (1 << 20) - 1, 1 << 20,
               (1 << 20) + 1, (1 << 30) - 28, 1 << 30, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1,
               1 << 63, (1 << 64) - 1]


def _deep(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf] if depth % 2 else {"d": leaf}
    return leaf


# JSON values of every wrong type and size for the fields; NaN and infinities are written by
# json.dumps as the non-JSON literals NaN / Infinity, which the decoder must refuse too.
GARBAGE = [
    None, True, False, 0, -1, 1, 3.5, -0.0, 5e-324, 1e308, float("nan"), float("inf"), float("-inf"),
    (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), -(1 << 63) - 1, 10**40, -(10**40),
    "", "x", "3", "learner-0", "learner-\u0663", "learner-\uff10", "\u0000", "a" * 256, "a" * 257, "é" * 257,
    [], [1, "a"], [None], {}, {"k": 1}, {"": 1}, {"k": -1}, {"k": 1 << 63}, {"k": "v"}, {"k" * 257: 1},
    {"learner-0": 1.5}, {"learner-0": True}, _deep(15, 1), _deep(16, 1), _deep(17, 1), _deep(40, "x"),
]
# Raw text spliced into a JSON header: broken syntax, numbers json.loads cannot or must not
# hold, invalid UTF-8 (stray continuation byte, encoded surrogate, overlong NUL).
TOKENS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"9" * 5000, b"[" * 3000, b"{" * 3000, b'"\\u0000"',
    b"\\", b"{", b"}", b"[", b"]", b",", b":", b'"', b"null", b"true", b"1.0", b"-0", b"0x10", b"01", b"\x80",
    b"\xff", b"\xed\xa0\x80", b"\xc0\x80", b"\x00", b" ", b'"sender"', b'"meta"', b'"payload"', b'"extra":1,',
    b'"\\ud800"', b'"x\\udfff"', b'"\\ud83d\\ude00"',  # lone surrogates (refused), a pair (fine)
]


SPLICE = "\x00splice here\x00"  # placeholder value, replaced by a raw token in the JSON text


def _seal(kind: int, header: bytes, payload: bytes) -> bytes:
    """A message with correct lengths and checksum around whatever header and payload."""
    head = PRELUDE.pack(MESSAGE_MAGIC, WIRE_VERSION, kind, 0, len(header), len(payload)) + header
    return head + payload + TRAILER.pack(xxhash.xxh3_64_intdigest(head + payload))


def _parts(data: bytes) -> tuple[int, bytes, bytes]:
    """(kind, header, payload) of a valid encoding."""
    _, _, kind, _, hlen, plen = PRELUDE.unpack_from(data)
    return kind, data[PRELUDE_BYTES:PRELUDE_BYTES + hlen], data[PRELUDE_BYTES + hlen:PRELUDE_BYTES + hlen + plen]


def _mutate_bytes(rng, data: bytearray, ops: int, tokens: bool = False) -> bytearray:
    for _ in range(ops):
        at = int(rng.integers(0, len(data) + 1))
        op = int(rng.integers(0, 7))
        if op == 0 and at < len(data):
            data[at] ^= int(rng.integers(1, 256))
        elif op == 1:
            ins = TOKENS[int(rng.integers(len(TOKENS)))] if tokens else rng.bytes(int(rng.integers(1, 9)))
            data[at:at] = ins
        elif op == 2:
            del data[at:at + int(rng.integers(1, 33))]
        elif op == 3:
            del data[at:]
        elif op == 4:  # a field-sized integer, preferably over the prelude's fields
            at = int(rng.integers(4, PRELUDE_BYTES)) if rng.random() < 0.5 else at
            fmt = ("<B", "<H", "<I", "<Q")[int(rng.integers(4))]
            value = INTERESTING[int(rng.integers(len(INTERESTING)))] % (1 << (8 * struct.calcsize(fmt)))
            data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        elif op == 5 and len(data) > 1:  # repeat a slice: duplicated keys, doubled brackets
            a, b = sorted(int(x) for x in rng.integers(0, len(data), 2))
            data[b:b] = data[a:b][:64]
        elif op == 6 and at < len(data):
            data[at] = int(rng.integers(0, 256))
    return data


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _garbage(rng):
    return _pick(rng, GARBAGE)


def _mutate_fields(rng, fields: dict) -> dict:
    """Delete, add or replace header fields (and entries of meta / clock)."""
    for _ in range(int(rng.integers(1, 4))):
        op, names = int(rng.integers(0, 5)), sorted(fields)
        name = names[int(rng.integers(len(names)))] if names else "sender"
        if op == 0:
            fields.pop(name, None)
        elif op == 1:
            fields[("extra", "payload", "Sender", "sender ", "")[int(rng.integers(5))]] = _garbage(rng)
        elif op in (2, 3):
            fields[name] = _garbage(rng)
        elif isinstance(fields.get(name), dict):  # an entry inside meta or clock
            key = ("learner-0", "", "k" * 257, "x", "syncer")[int(rng.integers(5))]
            fields[name] = {**fields[name], key: _garbage(rng)}
    return fields


# random, prelude, bytes mutated, header bytes resealed, fields resealed, lengths forged, truncated,
# concatenated, trailing bytes, valid: most weight where the input gets past the checksum.
HOW_WEIGHTS = np.array([5, 8, 12, 25, 25, 7, 6, 4, 4, 4]) / 100


def make_input(rng) -> tuple[str, bytes]:
    """One fuzz input and how it was made."""
    i = int(rng.integers(len(ENCODED)))
    seed = ENCODED[i]
    how = int(rng.choice(10, p=HOW_WEIGHTS))
    if how == 0:
        return "random", rng.bytes(int(rng.integers(0, 120)))
    if how == 1:  # a plausible prelude, then anything
        kind, flags = int(rng.integers(0, 8)), 0 if rng.random() < 0.8 else int(rng.integers(0, 1 << 16))
        version = WIRE_VERSION if rng.random() < 0.8 else int(rng.integers(0, 256))
        hlen, plen = (int(rng.integers(0, 64)) if rng.random() < 0.6 else _pick(rng, INTERESTING) for _ in range(2))
        prelude = struct.pack("<4sBBHIQ", MESSAGE_MAGIC, version, kind, flags, hlen % (1 << 32), plen)
        return "prelude", prelude + rng.bytes(int(rng.integers(0, 80)))
    if how == 2:
        return f"seed {i} bytes mutated", bytes(_mutate_bytes(rng, bytearray(seed), int(rng.integers(1, 5))))
    if how == 3:  # header bytes mutated, then lengths and checksum made right again
        kind, header, payload = _parts(seed)
        header = _mutate_bytes(rng, bytearray(header), int(rng.integers(1, 4)), tokens=True)
        if rng.random() < 0.2:
            payload = bytes(_mutate_bytes(rng, bytearray(payload), 1))
        if rng.random() < 0.15:
            kind = int(rng.integers(1, 6))  # one kind's header under another kind
        return f"seed {i} header bytes mutated, resealed", _seal(kind, bytes(header), payload)
    if how == 4:  # header fields mutated as JSON, resealed
        kind, header, payload = _parts(seed)
        fields = _mutate_fields(rng, json.loads(header))
        splice = rng.random() < 0.3 and fields
        if splice:  # a raw token where a value goes: NaN, 1e400, 5000 digits, 3000 brackets...
            names = sorted(fields)
            fields[names[int(rng.integers(len(names)))]] = SPLICE
        if rng.random() < 0.1:
            fields = _garbage(rng)  # not an object at all
        text = json.dumps(fields, ensure_ascii=bool(rng.random() < 0.5)).encode()
        if splice:
            text = text.replace(json.dumps(SPLICE).encode(), TOKENS[int(rng.integers(len(TOKENS)))])
        if rng.random() < 0.1 and not payload:
            payload = rng.bytes(int(rng.integers(1, 16)))  # a payload where the kind has none
        return f"seed {i} fields mutated, resealed", _seal(kind, text, payload)
    if how == 5:  # lengths forged, maybe huge; checksum made right over what is there, or not
        data = bytearray(seed)
        hlen, plen = PRELUDE.unpack_from(data)[4:]
        if rng.random() < 0.7:
            hlen = INTERESTING[int(rng.integers(len(INTERESTING)))] % (1 << 32)
        if rng.random() < 0.7:
            plen = INTERESTING[int(rng.integers(len(INTERESTING)))]
        data[12:20] = struct.pack("<IQ", hlen, plen)
        if rng.random() < 0.5:
            body = bytes(data[:-TRAILER_BYTES])
            data[-TRAILER_BYTES:] = TRAILER.pack(xxhash.xxh3_64_intdigest(body))
        return f"seed {i} lengths forged", bytes(data)
    if how == 6:
        return f"seed {i} truncated", seed[:int(rng.integers(0, len(seed)))]
    if how == 7:
        j = int(rng.integers(len(ENCODED)))
        return f"seeds {i}+{j} concatenated", seed + ENCODED[j]
    if how == 8:
        return f"seed {i} with trailing bytes", seed + rng.bytes(int(rng.integers(1, 30)))
    return f"seed {i}", seed


def _as(rng, data: bytes):
    """The same bytes as bytes, bytearray or memoryview: the decoders take any of them."""
    return (bytes, bytearray, memoryview)[int(rng.integers(3))](data)


def _replay(case: int, how: str, data) -> str:
    return f"case {case} ({how}), input {bytes(data)[:400]!r}{' ...' if len(data) > 400 else ''}"


def _depth(v) -> int:
    if not isinstance(v, (dict, list)):
        return 0
    return 1 + max(map(_depth, v.values() if isinstance(v, dict) else v), default=0)


def _in_limits(name: str, typ: str, v) -> bool:
    """The schema's documented limits (messages.py docstrings), checked independently of its code."""
    if typ == "str":
        return type(v) is str and len(v) <= MAX_NAME_CHARS
    if typ == "int":
        return type(v) is int and 0 <= v <= MAX_INT
    if typ == "Clock":
        return type(v) is dict and all(k and _in_limits(name, "str", k) and _in_limits(name, "int", n)
                                       for k, n in v.items())
    assert typ == "Meta", typ
    return type(v) is dict and _depth(v) <= MAX_META_DEPTH and _json_ok(v)


def _json_ok(v) -> bool:
    if isinstance(v, dict):
        return all(type(k) is str and len(k) <= MAX_NAME_CHARS and _json_ok(x) for k, x in v.items())
    if isinstance(v, list):
        return all(map(_json_ok, v))
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return -(1 << 63) <= v <= MAX_INT
    return v is None or isinstance(v, (bool, str))


def check_reencodes(msg) -> None:
    """A decoded message is a valid message: within the schema's limits, and it encodes again, to the
    same message."""
    assert type(msg) in MESSAGE_TYPES.values()
    for f in dataclasses.fields(msg):
        if f.name != "payload":
            assert _in_limits(f.name, f.type, getattr(msg, f.name)), (f.name, getattr(msg, f.name))
    assert all(getattr(msg, name) for name in getattr(msg, "NON_EMPTY", ("sender",)))
    again = encode_message(msg)  # raises MessageError if decode let through what encode refuses
    assert decode_message(again) == msg
    if hasattr(msg, "payload"):
        assert msg.payload.readonly  # a view of the receive buffer: not writable by the handler


def test_decode_message_only_raises_message_error_and_what_decodes_reencodes():
    rng = np.random.default_rng(20240613)
    decoded, by_how = 0, {}
    for case in range(CASES):
        how, data = make_input(rng)
        limit = MAX_MESSAGE_BYTES if rng.random() < 0.9 else int(rng.choice([0, 20, 64, 300, 1000, 7000]))
        data = _as(rng, data)
        try:
            msg = decode_message(data, max_bytes=limit)
        except MessageError as e:
            assert str(e), _replay(case, how, data)
            msg = None
        except Exception as e:  # noqa: BLE001 - anything else is the bug this test looks for
            raise AssertionError(f"{type(e).__name__}: {e}; {_replay(case, how, data)}") from e
        if msg is not None:
            decoded += 1
            kind = " ".join(w for w in how.split() if not w.isdigit())
            by_how[kind] = by_how.get(kind, 0) + 1
            try:
                check_reencodes(msg)
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"decoded {msg!r} does not re-encode: {e!r}; {_replay(case, how, data)}") from e
        if how.startswith("seed ") and how.split(" ")[1].isdigit() and len(how.split()) == 2 and len(data) <= limit:
            assert msg == SEEDS[int(how.split()[1])], _replay(case, how, data)  # valid input decodes, unchanged
        if how.startswith("seeds "):
            assert msg is None, _replay(case, how, data)  # two messages are not one
    # The generator must reach past the checksum: resealed mutations that still decode
    # exercised the field checks on the way (and passed re-encoding above).
    assert decoded > CASES // 20 and by_how.get("seed", 0) > 0, (decoded, by_how)


def reference(data: bytes, limit: int) -> tuple[list, str]:
    """What a reader must make of ``data``: its messages, one after another, via decode_message;
    then "idle" (all consumed), "partial" (a message begun) or "error"."""
    out, off = [], 0
    while off < len(data):
        if len(data) - off < PRELUDE_BYTES:
            return out, "partial"
        try:
            total = message_length(data[off:off + PRELUDE_BYTES])
        except MessageError:
            return out, "error"
        if total > limit:
            return out, "error"
        if len(data) - off < total:
            return out, "partial"
        try:
            out.append(decode_message(data[off:off + total], max_bytes=limit))
        except MessageError:
            return out, "error"
        off += total
    return out, "idle"


def _cuts(rng, data: bytes) -> list[int]:
    """Chunk boundaries: none, random ones, every byte, or around the fields of the first message."""
    n, how = len(data), int(rng.integers(0, 4))
    if how == 0 or n < 2:
        return []
    if how == 1:
        return sorted(set(int(x) for x in rng.integers(1, n, int(rng.integers(1, 9)))))
    if how == 2 and n <= 160:
        return list(range(1, n))
    try:
        _, _, _, _, hlen, plen = PRELUDE.unpack_from(data)
    except struct.error:
        return []
    body = PRELUDE_BYTES + hlen + plen
    ends = [PRELUDE_BYTES, PRELUDE_BYTES + hlen, body, body + TRAILER_BYTES]
    near = (c + int(rng.integers(-1, 2)) for c in ends)  # at, just before or just after each boundary
    return sorted({c for c in near if 0 < c < n})


def test_reader_at_any_chunk_boundaries_agrees_with_decode_message():
    rng = np.random.default_rng(613)
    shared = BufferPool(keep=2)
    kept: list[tuple[Frame, bytes]] = []  # earlier payloads, still referenced: must never change
    completed = 0
    for case in range(CASES):
        parts = [make_input(rng) for _ in range(int(rng.integers(1, 4)))]
        how = " + ".join(h for h, _ in parts)
        data = b"".join(d for _, d in parts)
        limit = 1 << 20 if rng.random() < 0.9 else int(rng.choice([20, 64, 300, 1000, 7000]))
        try:
            want, want_state = reference(data, limit)
        except Exception as e:  # noqa: BLE001 - decode_message itself failed: report the input
            raise AssertionError(f"{type(e).__name__}: {e}; {_replay(case, how, data)}") from e
        reader = MessageReader(limit, shared if rng.random() < 0.5 else None)
        got, state, bounds = [], "idle", [0, *_cuts(rng, data), len(data)]
        as_type = (bytes, bytearray, memoryview)[int(rng.integers(3))]  # what gRPC or a test hands in
        try:
            for a, b in zip(bounds, bounds[1:]):
                got += reader.feed(as_type(data[a:b]))
            state = "idle" if reader.idle else "partial"
        except MessageError:
            state = "error"
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{type(e).__name__}: {e}; cuts {bounds}; {_replay(case, how, data)}") from e
        where = f"cuts {bounds}; {_replay(case, how, data)}"
        if state == "error":
            # Messages completed earlier in the failing feed call are lost with it; the rest agree.
            assert want_state == "error" and got == want[:len(got)], (got, want, want_state, where)
        else:
            assert (got, state) == (want, want_state), (got, state, want, want_state, where)
        for msg in got:
            check_reencodes(msg)
            if isinstance(msg, Frame) and len(msg.payload) > 1000:
                kept.append((msg, bytes(msg.payload)))
        completed += len(got)
        kept = kept[-4:]
        # A pooled buffer is reused only once nothing refers to it: held payloads stay intact.
        assert all(bytes(m.payload) == b for m, b in kept), where
    assert completed > CASES // 20, completed  # and not only errors: whole messages came through


# json.loads turns a \ud800 escape into a lone surrogate, which no UTF-8 encoder takes back: once
# let through as a Probe's sender, it became a Prometheus label and /metrics failed from then on.
@pytest.mark.parametrize("header", [
    '{"sender":"\\ud800","global_step":0,"detail":""}',
    '{"sender":"learner-0","fragment":0,"meta":{"\\udfff":1}}',
    '{"sender":"learner-0","fragment":0,"meta":{"k":["\\ud83d"]}}',
    '{"sender":"learner-0","name":"global","clock":{},"offset":5,"etag":"v\\ud83d"}',
])
def test_lone_surrogates_are_refused_on_decode(header):
    kind = 5 if "global_step" in header else 3 if "etag" in header else 1
    with pytest.raises(MessageError, match="not valid Unicode"):
        decode_message(_seal(kind, header.encode(), b""))
    paired = header.replace("\\ud83d", "\\ud83d\\ude00")  # a surrogate pair is one character: fine
    if paired != header:
        check_reencodes(decode_message(_seal(kind, paired.encode(), b"")))
