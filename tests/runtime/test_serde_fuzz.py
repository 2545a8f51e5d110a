"""Fuzz the protocol decoders of ``runtime.serde`` and ``FragmentCodec.decode`` (#13).

Seeded loops over a numpy RNG, 10,000 cases per decoder: metadata_from_frame,
upload_from_frame, update_from_frame, control_from_frame (Identity, Donate),
donation_from_frame and fragment_from_bulk get valid frames of every kind (built
as in test_serde.py) with mutated meta (fields missing, unknown, of the wrong
type, huge, negative, deeply nested, too long), senders in every spelling of a
learner id, other fragments and broken payloads. Half the frames travel through
the transport's bytes first, as a receiver gets them; the other half go as built
(cheaper, and payloads of bytes rather than read-only views). Only ProtocolError
may escape; what decodes must be well-formed (a canonical sender, the layout's
finite float32 tensors) and encode again to the same message. A failure names
the case and the mutations, to replay it.
"""
from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from wan_diloco import transport
from wan_diloco.clock import VectorClock
from wan_diloco.compression import FRAGMENT_MAGIC, CodecConfig, CodecError, FragmentCodec
from wan_diloco.core import FragmentUpload, GlobalUpdate, Metadata, ProtocolError
from wan_diloco.core.protocol import SYNCER, learner_node
from wan_diloco.fragments import Layout
from wan_diloco.runtime import serde
from wan_diloco.transport.messages import MAX_INT

CASES = 10_000

LAYOUT = Layout([("a", "b"), ("c",)], {"a": (2, 3), "b": (4,), "c": (5,)})
FP32 = FragmentCodec(CodecConfig(bits=32), LAYOUT)
INT8 = FragmentCodec(CodecConfig(bits=8, block_size=16), LAYOUT)
BULK = FragmentCodec(CodecConfig(bits=32, zstd=False), LAYOUT)


def values(seed: int, fragment: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=LAYOUT.shapes[n]).astype(np.float32) for n in LAYOUT.fragments[fragment]}


def metadata(learner: int = 2) -> Metadata:
    return Metadata(learner=learner, step=12, c_steps=(3, 0), c_tokens=(3072, 0),
                    clock=VectorClock({learner_node(learner): 12}), step_s=0.125, sync_s=None, region="eu")


def upload(codec, fragment: int = 0, learner: int = 2) -> FragmentUpload:
    enc = codec.roundtrip(values(1, fragment))
    return FragmentUpload(learner=learner, fragment=fragment, due_step=24, base_version=3, c_steps=8, c_tokens=1024,
                          clock=VectorClock({learner_node(learner): 5, SYNCER: 4}), delta=enc.values,
                          nbytes=enc.nbytes, payload=enc.payload, region="eu", final=True)


def update(codec, fragment: int = 0) -> GlobalUpdate:
    enc = codec.roundtrip(values(2, fragment))
    return GlobalUpdate(fragment=fragment, from_version=4, to_version=5, due_step=24, global_step=30,
                        clock=VectorClock({SYNCER: 9}), update=enc.values, nbytes=enc.nbytes, contributors=(1, 2),
                        held_s={1: 0.25, 12: 1.5}, payload=enc.payload, final=False)


def wire(frame: transport.Frame) -> transport.Frame:
    """``frame`` as a receiver gets it: through the transport's bytes (in a fresh buffer)."""
    return transport.decode_message(bytearray(transport.encode_message(frame)))


# Every spelling of a learner id we could think of; only "learner-N" with N in range is one.
# Unicode digits pass str.isdigit() and int() ("learner-\u0661" would be learner 1).
SENDERS = [
    "learner-0", "learner-1", "learner-2", "learner-3", "learner-12", "learner-13",
    "learner-00", "learner-01", "learner-002", "learner-\u0661", "learner-\u0660", "learner-\uff10", "learner-\uff11",
    "learner-\u00b9", "learner-\u0967", "learner-\U0001d7cf", "learner-\u0661\u0662", "learner-1\u200b",
    "learner-1 ", " learner-1", "learner-1\n", "Learner-1", "LEARNER-1", "learner_1", "learner-+1", "learner--1",
    "learner-1.0", "learner-1e0", "learner-0x1", "learner-" + "1" * 18, "learner-" + "9" * 19, "learner-" + "1" * 240,
    "learner-", "learner", "", "syncer", "learner-1/0",
]
NUM_LEARNERS = [1, 3, 4, 13]


def _deep(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf] if depth % 2 else {"d": leaf}
    return leaf


GARBAGE = [
    None, True, False, 0, 1, -1, 2, 3.5, -0.0, 5e-324, 1e308, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), 10**40,
    "", "x", "3", "1.5", "true", "learner-0", "learner-\u0661", "\u0663", "a" * 256, "a" * 257, "\U0001f600" * 300,
    [], [1, 2], [-1], [True], [1.5], [1 << 63], ["1"], [[1]], [None], {}, {"a": 1}, {"learner-0": 5},
    {"learner-0": -1}, {"learner-0": True}, {"learner-0": 1.0}, {"": 1}, {"learner-\u0661": 1}, {"syncer": 1 << 63},
    {"1": 1.0}, {"01": 1.0}, {"-1": 1.0}, {"\u0661": 1.0}, {"\uff11": 1.0}, {"1" * 19: 1.0}, {"1": "slow"},
    {"1": None}, {"identity": {}}, _deep(15, 1), _deep(17, 1), _deep(40, [1]),
]
EXTRA_FIELDS = ["learner", "fragment", "delta", "update", "payload", "nbytes", "extra", "", "Step", "identity"]


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def mutate_meta(rng, meta, steps: list[str]):
    """1-3 of: a field dropped, an unknown one added, one replaced, an entry inside one replaced,
    or the whole meta replaced by something that is not an object."""
    meta = dict(meta)
    for _ in range(int(rng.integers(1, 4))):
        op, names = int(rng.integers(0, 10)), sorted(meta)
        name = _pick(rng, names) if names else "x"
        if op == 0:
            meta.pop(name, None)
            steps.append(f"drop {name}")
        elif op == 1:
            extra = _pick(rng, EXTRA_FIELDS)
            meta[extra] = _pick(rng, GARBAGE)
            steps.append(f"add {extra}={meta[extra]!r:.40}")
        elif op in (2, 3, 4, 5):
            meta[name] = _pick(rng, GARBAGE)
            steps.append(f"{name}={meta[name]!r:.60}")
        elif op in (6, 7, 8) and isinstance(meta.get(name), dict):
            key = _pick(rng, [*SENDERS[:8], "syncer", "1", "01", "\u0661", "x", "run_id", "epoch"])
            meta[name] = {**meta[name], key: _pick(rng, GARBAGE)}
            steps.append(f"{name}[{key!r}]={meta[name][key]!r:.40}")
        elif op in (6, 7, 8) and isinstance(meta.get(name), list) and meta[name]:
            meta[name] = list(meta[name])
            meta[name][int(rng.integers(len(meta[name])))] = _pick(rng, GARBAGE)
            steps.append(f"{name}[i]=...")
        elif op == 9:
            steps.append("meta replaced")
            return _pick(rng, GARBAGE)
    return meta


def mutate_payload(rng, payload: bytes, others: list[bytes], steps: list[str]) -> bytes:
    op = int(rng.integers(0, 7))
    steps.append(f"payload op {op}")
    if op == 0:
        return _pick(rng, others)  # another codec's or another fragment's payload
    if op == 1:
        return payload[:int(rng.integers(0, len(payload) + 1))]
    if op == 2 and payload:
        b = bytearray(payload)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(len(b)))] ^= int(rng.integers(1, 256))
        return bytes(b)
    if op == 3:
        return rng.bytes(int(rng.integers(0, 200)))
    if op == 4:
        return payload + rng.bytes(int(rng.integers(1, 8)))
    if op == 5:
        return b""
    return payload


NOT_ENCODABLE, AS_BUILT = "not encodable: given as built", "given as built"


def mutate_frame(rng, frame: transport.Frame, others: list[bytes], steps: list[str],
                 p_sender: float = 0.3, p_wire: float = 0.5) -> transport.Frame:
    changes = {}
    if rng.random() < p_sender:
        changes["sender"] = _pick(rng, SENDERS)
        steps.append(f"sender {changes['sender']!r:.40}")
    if rng.random() < 0.6 and isinstance(frame.meta, dict):
        changes["meta"] = mutate_meta(rng, frame.meta, steps)
    if rng.random() < 0.15:
        changes["fragment"] = _pick(rng, [0, 1, 2, 7, 1 << 31, (1 << 63) - 1])
        steps.append(f"fragment {changes['fragment']}")
    if rng.random() < 0.3:
        changes["payload"] = mutate_payload(rng, bytes(frame.payload), others, steps)
    frame = dataclasses.replace(frame, **changes)
    if rng.random() >= p_wire:  # as built: half the cost, and a payload of bytes rather than a read-only view
        steps.append(AS_BUILT)
        return frame
    try:
        return wire(frame)
    except transport.MessageError:
        steps.append(NOT_ENCODABLE)  # e.g. a key of 257 characters: given as built
        return frame


def on_wire(frame: transport.Frame, steps: list[str]) -> bool:
    """Whether a receiver can get ``frame``. One it cannot (a clock entry past int64, a key of 257
    characters) is still decoded above, but only what can travel must encode again."""
    if NOT_ENCODABLE in steps:
        return False
    if AS_BUILT not in steps:
        return True
    try:
        transport.encode_message(frame)
    except transport.MessageError:
        return False
    return True


def check_tensors(out: dict, fragment: int) -> None:
    assert list(out) == list(LAYOUT.fragments[fragment])
    for n, a in out.items():
        assert a.dtype == np.float32 and a.shape == LAYOUT.shapes[n] and np.isfinite(a).all(), n


def check_learner(sender: str, learner: int, n: int) -> None:
    """The one spelling of a learner id: exactly learner_node(m) for m < n (an independent oracle)."""
    assert sender in {learner_node(m) for m in range(n)}, sender
    assert learner_node(learner) == sender and 0 <= learner < n


def run_fuzz(seed: int, make, decode, check) -> dict:
    """CASES cases: ``make(rng, steps)`` -> input, ``decode(input)``; ProtocolError is the only refusal,
    ``check(input, result, steps)`` judges what decodes. Returns how many decoded."""
    rng = np.random.default_rng(seed)
    stats = {"decoded": 0, "refused": 0}
    for case in range(CASES):
        steps: list[str] = []
        data = make(rng, steps)
        try:
            result = decode(data)
        except ProtocolError as e:
            assert str(e), f"case {case}: ProtocolError without a text; {steps}"
            stats["refused"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - anything else is the bug this test looks for
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}; mutations {steps}; input {data!r:.600}") from e
        try:
            check(data, result, steps)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"case {case}: decoded {result!r:.300} is wrong: {e!r:.300}; mutations {steps}; "
                                 f"input {data!r:.600}") from e
        stats["decoded"] += 1
    # Not only refusals: some mutations keep the message valid (a value changed within range).
    assert stats["decoded"] > CASES // 50, stats
    return stats


def same_fields(a, b, tensors: str) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == tensors:
            assert list(x) == list(y) and all(x[n].tobytes() == y[n].tobytes() for n in x)
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


# ---- metadata, uploads, updates, identities ---------------------------------------------------

META_FRAMES = [serde.to_frame(metadata(m)) for m in (0, 2)]


def test_fuzz_metadata_from_frame():
    def make(rng, steps):
        n = _pick(rng, NUM_LEARNERS)
        steps.append(f"num_learners {n}")
        return mutate_frame(rng, _pick(rng, META_FRAMES), [b"x"], steps), n

    def check(data, msg, steps):
        frame, n = data
        assert isinstance(msg, Metadata) and frame.fragment == 0 and not len(frame.payload)
        check_learner(frame.sender, msg.learner, n)
        if on_wire(frame, steps):
            assert serde.metadata_from_frame(wire(serde.to_frame(msg)), n) == msg

    run_fuzz(1, make, lambda d: serde.metadata_from_frame(d[0], d[1]), check)


UPLOADS = [(codec, serde.to_frame(upload(codec, p, m))) for codec in (FP32, INT8) for p in (0, 1) for m in (0, 2)]
UPDATES = [(codec, serde.to_frame(update(codec, p))) for codec in (FP32, INT8) for p in (0, 1)]
PAYLOADS = [bytes(f.payload) for _, f in UPLOADS + UPDATES]


def test_fuzz_upload_from_frame():
    def make(rng, steps):
        codec, frame = _pick(rng, UPLOADS)
        n = _pick(rng, NUM_LEARNERS)
        steps.append(f"codec bits {codec.cfg.bits}, num_learners {n}")
        return mutate_frame(rng, frame, PAYLOADS, steps), codec, n

    def check(data, up, steps):
        frame, codec, n = data
        assert isinstance(up, FragmentUpload) and up.payload is None and up.nbytes == len(frame.payload)
        check_learner(frame.sender, up.learner, n)
        assert up.fragment == frame.fragment
        check_tensors(up.delta, up.fragment)
        if not on_wire(frame, steps):
            return
        again = serde.upload_from_frame(wire(serde.to_frame(dataclasses.replace(up, payload=bytes(frame.payload)))),
                                        codec, n)
        same_fields(again, up, "delta")

    run_fuzz(2, make, lambda d: serde.upload_from_frame(*d), check)


def test_fuzz_update_from_frame():
    def make(rng, steps):
        codec, frame = _pick(rng, UPDATES)
        steps.append(f"codec bits {codec.cfg.bits}")
        return mutate_frame(rng, frame, PAYLOADS, steps, p_sender=0.1), codec

    def check(data, g, steps):
        frame, codec = data
        assert isinstance(g, GlobalUpdate) and g.payload is None and frame.sender == SYNCER
        assert g.fragment == frame.fragment and g.nbytes == len(frame.payload)
        check_tensors(g.update, g.fragment)
        if not on_wire(frame, steps):
            return
        again = serde.update_from_frame(wire(serde.to_frame(dataclasses.replace(g, payload=bytes(frame.payload)))),
                                        codec)
        same_fields(again, g, "update")

    run_fuzz(3, make, lambda d: serde.update_from_frame(*d), check)


CONTROLS = [serde.control_to_frame(serde.Identity("run-a", 3, 7, "9f2c01d4e5a6b7c8")), serde.control_to_frame(serde.Donate(1, (3, 0)))]


def test_fuzz_control_from_frame():
    def make(rng, steps):
        frame = _pick(rng, [*CONTROLS, UPDATES[0][1]])
        inner = next((k for k in ("identity", "donate") if k in frame.meta), None)
        if inner and rng.random() < 0.5:  # the inner object is where the fields are
            frame = dataclasses.replace(frame, meta={**frame.meta, inner: mutate_meta(rng, frame.meta[inner], steps)})
        return mutate_frame(rng, frame, [b"", b"x"], steps, p_sender=0.15)

    def check(frame, msg, steps):
        meta = frame.meta
        kinds = [k for k in ("identity", "donate") if isinstance(meta, dict) and k in meta]
        if msg is None:  # not a control frame: a GlobalUpdate's
            assert not kinds
            return
        assert frame.sender == SYNCER and len(meta) == 1 and not len(frame.payload)
        assert type(msg) is {"identity": serde.Identity, "donate": serde.Donate}[kinds[0]]
        for f in dataclasses.fields(msg):
            v = getattr(msg, f.name)
            assert (type(v) is str if f.name in ("run_id", "process") else type(v) is tuple if f.name == "versions"
                    else type(v) is int and v >= 0), (f.name, v)
        if isinstance(msg, serde.Donate) and msg.recipient > MAX_INT - serde.DONATE_KEY:
            return  # known, not sendable again: test_a_donate_frame_for_no_possible_learner_is_refused
        if on_wire(frame, steps):
            assert serde.control_from_frame(wire(serde.control_to_frame(msg))) == msg

    run_fuzz(4, make, serde.control_from_frame, check)


def test_a_donate_frame_for_no_possible_learner_is_refused():
    # Such a Donate decodes, but control_to_frame cannot send it again: its fan-out key,
    # DONATE_KEY + recipient, is past int64 (and no run has that many learners).
    frame = wire(transport.Frame(SYNCER, 0, {"donate": {"recipient": (1 << 63) - 1, "versions": [3, 0]}}))
    try:
        msg = serde.control_from_frame(frame)
    except ProtocolError:
        return
    raise AssertionError(f"decoded {msg!r}")


DONATIONS = [serde.donation_to_frame(d, serde.Donation(r, (3, 0), 0, 11, serde.bytes_digest(b"state bytes")),
                                     b"state bytes") for d, r in ((0, 1), (2, 0))]
# The form before meta.kind named the message, still accepted: the fields under meta.donation.
LEGACY_DONATIONS = [transport.Frame(f.sender, 0, {"donation": {k: v for k, v in f.meta.items() if k != "kind"}},
                                    f.payload) for f in DONATIONS]


def is_donation(meta) -> bool:
    return isinstance(meta, dict) and (meta.get("kind") == "donation" or ("kind" not in meta and "donation" in meta))


def test_fuzz_donation_from_frame():
    def make(rng, steps):
        frame = _pick(rng, [*DONATIONS, *LEGACY_DONATIONS, UPLOADS[0][1]])
        if "donation" in frame.meta and rng.random() < 0.5:
            frame = dataclasses.replace(frame, meta={"donation": mutate_meta(rng, frame.meta["donation"], steps)})
        elif frame.meta.get("kind") == "donation" and rng.random() < 0.5:
            frame = dataclasses.replace(frame, meta=mutate_meta(rng, frame.meta, steps))
        n = _pick(rng, NUM_LEARNERS)
        steps.append(f"num_learners {n}")
        return mutate_frame(rng, frame, [b"", b"x"], steps), n

    def check(data, got, steps):
        frame, n = data
        if got is None:  # not a donation: an ordinary upload's frame
            assert not is_donation(frame.meta)
            return
        donor, msg = got
        check_learner(frame.sender, donor, n)
        assert type(msg) is serde.Donation and 0 <= msg.recipient < n and msg.recipient != donor
        assert all(type(v) is int and v >= 0 for v in msg.versions)
        assert 0 < len(frame.payload) and msg.offset + len(frame.payload) <= msg.total_bytes
        if on_wire(frame, steps):
            again = wire(serde.donation_to_frame(donor, msg, bytes(frame.payload)))
            assert serde.donation_from_frame(again, n) == got

    run_fuzz(6, make, lambda d: serde.donation_from_frame(*d), check)


def test_a_learner_cannot_push_the_syncers_clock_past_what_the_wire_carries():
    from wan_diloco.core import SyncerConfig, SyncerCore

    params = {n: np.zeros(LAYOUT.shapes[n], np.float32) for n in ("a", "b", "c")}
    core = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), LAYOUT.fragments, params,
                      lambda name: False, FP32)
    hostile = dataclasses.replace(metadata(1), clock=VectorClock({"learner-1": 12, SYNCER: MAX_INT}))
    try:  # a valid message on the wire, from a token holder
        core.on_metadata(0.0, serde.metadata_from_frame(wire(serde.to_frame(hostile)), 2))
    except ProtocolError:
        return  # refused: fine
    honest = dataclasses.replace(upload(FP32, fragment=0, learner=0), base_version=0, final=False)
    actions = core.on_fragment(1.0, serde.upload_from_frame(wire(serde.to_frame(honest)), FP32, 2))
    updates = [a.msg for a in actions if isinstance(getattr(a, "msg", None), GlobalUpdate)]
    assert len(updates) == 1, actions  # quorum 1: the honest upload closes the round at once
    try:
        transport.encode_message(serde.to_frame(updates[0]))
    except transport.MessageError as e:
        raise AssertionError(f"the syncer's next update cannot be sent: {e}") from None


# ---- bulk objects -----------------------------------------------------------------------------

BULKS = [serde.fragment_to_bulk(p, 7, 99, values(5, p), BULK, run_id="run-a", epoch=2, resumed_from=5)
         for p in (0, 1)]
BULK_PAYLOADS = [bytes(transport.decode_message(b).payload) for b in BULKS] + PAYLOADS


def test_fuzz_fragment_from_bulk():
    def make(rng, steps):
        data = _pick(rng, BULKS)
        if rng.random() < 0.7:  # mutate the frame inside, then encode it again (a valid checksum)
            frame = mutate_frame(rng, transport.decode_message(data), BULK_PAYLOADS, steps, p_sender=0.1, p_wire=0)
            try:
                data = transport.encode_message(frame)
            except transport.MessageError:
                steps.append("not encodable: the original bytes")
        if rng.random() < 0.3:  # bytes cut, flipped or spliced: the checksum or the prelude must notice
            b = bytearray(data)
            at = int(rng.integers(len(b) + 1))
            op = int(rng.integers(3))
            if op == 0:
                del b[at:]
            elif op == 1 and at < len(b):
                b[at] ^= 0x5A
            else:
                b[at:at] = rng.bytes(int(rng.integers(1, 9)))
            steps.append(f"bytes op {op} at {at}")
            data = bytes(b)
        return (bytes, bytearray, memoryview)[int(rng.integers(3))](data)

    def check(data, got, steps):
        assert isinstance(got, serde.BulkFragment) and got.fragment in (0, 1)
        check_tensors(got.values, got.fragment)
        assert all(a.flags.writeable and a.flags.owndata for a in got.values.values())  # copies, not views
        again = serde.fragment_from_bulk(serde.fragment_to_bulk(got.fragment, got.version, got.global_step, got.values,
                                                                BULK, got.run_id, got.epoch, got.resumed_from), BULK)
        assert again[:3] == got[:3] and again[4:] == got[4:]
        assert all(again.values[n].tobytes() == got.values[n].tobytes() for n in got.values)

    run_fuzz(5, make, lambda d: serde.fragment_from_bulk(d, BULK), check)


# ---- the fragment codec -----------------------------------------------------------------------

# As tests/compression/test_decode_fuzz.py: a scalar and an empty tensor beside ordinary ones.
_RNG = np.random.default_rng(7)
_FRAG = {"w": _RNG.standard_normal((5, 7)).astype(np.float32), "b": _RNG.standard_normal(3).astype(np.float32) * 1e-3,
         "s": np.float32(1.5), "e": np.zeros((0,), np.float32)}
CODEC_LAYOUT = Layout([tuple(_FRAG), ("x",)], {**{k: np.shape(v) for k, v in _FRAG.items()}, "x": (40,)})
CODECS = [FragmentCodec(CodecConfig(bits=bits, block_size=16, zstd=z, int4_codebook=cb), CODEC_LAYOUT)
          for bits, cb in [(32, "nf4"), (16, "nf4"), (8, "nf4"), (4, "nf4"), (4, "uniform")] for z in (False, True)]
CODEC_SEEDS = [(c, p, c.encode(_FRAG if p == 0 else {"x": np.linspace(-3, 3, 40, dtype=np.float32)}))
               for c in CODECS for p in (0, 1)]
# The fixed header of compression/frame.py: magic 4s, version, bits, flags, scale_dtype, codebook,
# reserved (B each), block_size H, fragment I, raw_len Q, payload_len Q.
FIELD_AT = {"version": (4, "<B"), "bits": (5, "<B"), "flags": (6, "<B"), "scale_dtype": (7, "<B"),
            "codebook": (8, "<B"), "reserved": (9, "<B"), "block_size": (10, "<H"), "fragment": (12, "<I"),
            "raw_len": (16, "<Q"), "payload_len": (24, "<Q")}
HEADER_BYTES = 32
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 64, 127, 128, 255, 256, 4095, 4096, 65535, 65536,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def test_fuzz_fragment_codec_decode():
    rng = np.random.default_rng(6)
    decoded = 0
    for case in range(CASES):
        codec, fragment, msg = _pick(rng, CODEC_SEEDS)
        msg, steps = bytearray(msg), []
        for _ in range(int(rng.integers(1, 4))):
            op, at = int(rng.integers(0, 7)), int(rng.integers(0, len(msg) + 1))
            if op == 0:
                del msg[at:]
            elif op == 1 and at < len(msg):
                msg[at] ^= int(rng.integers(1, 256))
            elif op == 2:
                msg[at:at] = rng.bytes(int(rng.integers(1, 17)))
            elif op == 3:
                del msg[at:at + int(rng.integers(1, 33))]
            elif op in (4, 5):  # a header field forged to an edge value
                name = _pick(rng, sorted(FIELD_AT))
                off, fmt = FIELD_AT[name]
                value = _pick(rng, INTERESTING) % (1 << (8 * struct.calcsize(fmt)))
                msg[off:off + struct.calcsize(fmt)] = struct.pack(fmt, value)
                at = f"{name}={value}"
            else:
                msg = bytearray(FRAGMENT_MAGIC + bytes([1]) + rng.bytes(int(rng.integers(0, 200))))
            steps.append((op, at))
        if rng.random() < 0.5 and len(msg) >= HEADER_BYTES:
            # payload_len made consistent, so that the deeper checks (raw_len, zstd, scales) run
            msg[24:32] = struct.pack("<Q", len(msg) - HEADER_BYTES)
        p = fragment if rng.random() < 0.9 else 1 - fragment
        try:
            out = codec.decode(p, bytes(msg))
        except CodecError as e:
            assert str(e), f"case {case}: CodecError without a text"
            continue
        except Exception as e:  # noqa: BLE001 - anything else is a bug (serde would pass it through)
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}; codec {codec.cfg}, fragment {p}, "
                                 f"mutations {steps}, input {bytes(msg)!r:.400}") from e
        decoded += 1
        assert list(out) == list(CODEC_LAYOUT.fragments[p]), (case, steps)
        for n, a in out.items():
            assert a.dtype == np.float32 and a.shape == CODEC_LAYOUT.shapes[n], (case, n, steps)
            assert np.isfinite(a).all(), f"case {case}: decoded NaN/Inf in {n!r}; mutations {steps}"
    assert decoded > CASES // 50, decoded  # some mutations (a flipped value byte) still decode


# ---- sender names: one spelling per learner ----------------------------------------------------

@pytest.mark.parametrize("sender", [s for s in SENDERS if s not in {learner_node(m) for m in range(20)}])
def test_every_other_spelling_of_a_learner_is_refused(sender):
    """#13: learner-00, learner-\u0661 (Arabic-Indic one) and learner-\uff10 (fullwidth zero) were taken for
    learners 0 and 1. The sender becomes a learner id in serde.learner_id and nowhere else in serde."""
    with pytest.raises(ProtocolError, match="is not a learner of this run"):
        serde.learner_id(sender, 20)
    for decode, frame in ((lambda f: serde.metadata_from_frame(f, 20), META_FRAMES[0]),
                          (lambda f: serde.upload_from_frame(f, FP32, 20), UPLOADS[0][1])):
        frame = dataclasses.replace(frame, sender=sender)
        try:
            frame = wire(frame)
        except transport.MessageError:
            continue  # the transport refuses it already (longer than 256 characters)
        with pytest.raises(ProtocolError, match="sender"):
            decode(frame)


def test_the_canonical_spelling_is_accepted():
    for m in range(13):
        assert serde.learner_id(learner_node(m), 13) == m
    assert serde.metadata_from_frame(wire(serde.to_frame(metadata(3))), 4).learner == 3
