"""The hostile peer's messages (#23): a deterministic stream of cases, each one call to a running syncer.

A case names what it mutates (``field``, a short dotted name such as ``metadata.step``), the value's
class (``at``: at a limit, an honest peer could still send it; ``past``: beyond it, no honest peer
sends it), the credential it is sent with and the sender it declares, and what must happen:

- ``refuse``: the syncer must refuse it (past a limit, a bad credential, or a sender that is not the
  credential's);
- ``either``: a compromised learner-2 may send it (a value at a limit): refused or taken, the run
  must stay right.

The attacker holds learner-2's credential (``derive_token(run_token, "learner-2")`` with per-learner
tokens, else the run's shared token) and also tries none, a wrong one and, under per-learner tokens,
the run's own. Messages are built with the project's encoders (``runtime.serde``, ``transport.messages``)
from a valid message, then mutated; values the encoders refuse (past int64, NaN, bad JSON) are written
into the header by hand (``raw_message``), checksum and prelude recomputed, so that the server's own
decoder is what refuses them. No pickle anywhere.
"""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable, Iterator

import xxhash

from wan_diloco.clock import VectorClock
from wan_diloco.core.protocol import Metadata, learner_node
from wan_diloco.runtime import serde
from wan_diloco.transport import messages as wire

ATTACKER = 2  # the compromised learner: configured, never started as a real process
HONEST = (0, 1)
MAX_CLOCK = 1 << 53
INT64_MAX = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class Context:
    """What the generator needs to know of the run (both ends derive it from the same config)."""

    learners: int
    steps: int
    fragments: int
    max_probe_bytes: int = 256 << 20
    slow_streams: int = 20  # at most this many slow uploads (each holds a server slot for a few seconds)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call. ``build(live)`` gives the request bytes (or, for an upload, its chunks) given the
    syncer's live state (``live``: current versions, epoch, global step), read just before sending."""

    i: int
    rpc: str  # Metadata | Upload | Subscribe | Bulk | Probe | SlowUpload
    field: str
    value: str  # short label of the value sent
    limit: str  # "at" | "past" | "valid" | "cred" | "identity"
    cred: str  # own | none | wrong | run
    sender: str  # declared in the message (the frame's sender)
    header_sender: str  # x-wdl-sender call metadata
    expect: str  # refuse | either
    build: Callable[[dict], Any] = dataclasses.field(compare=False, repr=False)

    def row(self) -> dict:
        return {"i": self.i, "rpc": self.rpc, "field": self.field, "value": self.value, "limit": self.limit,
                "cred": self.cred, "sender": self.sender, "header_sender": self.header_sender, "expect": self.expect}

    @property
    def impersonates(self) -> bool:
        """Declares (in the frame or the call) a sender other than the attacker's own learner."""
        own = learner_node(ATTACKER)
        return self.sender != own or self.header_sender != own


def raw_message(kind: wire.Kind, header: Any, payload: bytes = b"") -> bytes:
    """A message with ``header`` as given (a dict dumped as JSON, or text), no validation: what a peer
    that does not use our encoder could send. Prelude and checksum are right, so the receiver's decoder
    judges the header itself."""
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    head = wire.PRELUDE.pack(wire.MESSAGE_MAGIC, wire.WIRE_VERSION, int(kind), 0, len(text.encode()), len(payload))
    body = head + text.encode() + payload
    return body + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def frame_bytes(sender: str, fragment: int, meta: Any, payload: bytes = b"") -> bytes:
    """A Frame through the transport's encoder when it takes it, else by hand (int64 overflow, NaN...)."""
    try:
        return wire.encode_message(wire.Frame(sender, fragment, meta, payload))
    except wire.MessageError:
        return raw_message(wire.Kind.FRAME, {"sender": sender, "fragment": fragment, "meta": meta}, payload)


def valid_metadata(ctx: Context, m: int, step: int = 1) -> dict:
    """The meta of an honest-looking Metadata of learner ``m`` (serde's own JSON form)."""
    msg = Metadata(learner=m, step=step, c_steps=(step,) * ctx.fragments, c_tokens=(step * 128,) * ctx.fragments,
                   clock=VectorClock({learner_node(m): step}), step_s=0.2, sync_s=0.01, region="",
                   tau=1, epoch=0, snapshot=0, data="", loss=5.0, tokens=step * 128)
    return dict(serde.to_frame(msg).meta)


# ---- the families of cases ------------------------------------------------------------------------

def _metadata_mutations(ctx: Context) -> list[tuple[str, str, str, Callable[[dict, dict], Any]]]:
    """(field, value label, limit, mutate(meta, live) -> meta) for the Metadata RPC."""
    S, P = ctx.steps, ctx.fragments
    me = learner_node(ATTACKER)

    def setf(name, value):
        return lambda meta, live: {**meta, name: value(live) if callable(value) else value}

    def clock(entries):
        return lambda meta, live: {**meta, "clock": entries(live) if callable(entries) else entries}

    out = [
        # step: the budget (issue case 1), just past the old cap, the clock's and the wire's ends
        ("metadata.step", "steps", "past", setf("step", S)),
        ("metadata.step", "steps+9", "past", setf("step", S + 9)),
        ("metadata.step", "global+1000", "past", setf("step", lambda live: live.get("global_step", 0) + 1000)),
        ("metadata.step", "2**53", "past", setf("step", MAX_CLOCK)),
        ("metadata.step", "int64_max", "past", setf("step", INT64_MAX)),
        ("metadata.step", "2**63", "past", setf("step", 1 << 63)),
        ("metadata.step", "-1", "past", setf("step", -1)),
        ("metadata.step", "1.5", "past", setf("step", 1.5)),
        ("metadata.step", "'1'", "past", setf("step", "1")),
        ("metadata.step", "global", "at", setf("step", lambda live: max(1, live.get("global_step", 0)))),
        ("metadata.c_steps", "P+1 entries", "past", setf("c_steps", [1] * (P + 1))),
        ("metadata.c_steps", "empty", "past", setf("c_steps", [])),
        ("metadata.c_steps", "int64_max", "past", setf("c_steps", [INT64_MAX] * P)),
        ("metadata.c_tokens", "int64_max", "past", setf("c_tokens", [INT64_MAX] * P)),
        ("metadata.c_tokens", "-1", "past", setf("c_tokens", [-1] * P)),
        ("metadata.clock", "self 2**53", "at", clock({me: MAX_CLOCK})),
        ("metadata.clock", "self 2**53+1", "past", clock({me: MAX_CLOCK + 1})),
        ("metadata.clock", "syncer 2**53", "past", clock({me: 1, "syncer": MAX_CLOCK})),
        ("metadata.clock", "syncer int64_max", "past", clock({me: 1, "syncer": INT64_MAX})),
        ("metadata.clock", "learner-0 2**53", "past", clock({me: 1, learner_node(0): MAX_CLOCK})),
        ("metadata.clock", "unknown node", "past", clock({me: 1, "mallory": 5})),
        ("metadata.clock", "300 nodes", "past", clock({f"n{k}": 1 for k in range(300)})),
        ("metadata.clock", "-1", "past", clock({me: -1})),
        ("metadata.clock", "not a map", "past", clock([1, 2])),
        ("metadata.step_s", "0", "at", setf("step_s", 0.0)),
        ("metadata.step_s", "-1", "past", setf("step_s", -1.0)),
        ("metadata.step_s", "1e308", "past", setf("step_s", 1e308)),
        ("metadata.sync_s", "-1", "past", setf("sync_s", -1.0)),
        ("metadata.tau", "1000", "at", setf("tau", 1000)),
        ("metadata.tau", "1001", "past", setf("tau", 1001)),
        ("metadata.tau", "int64_max", "past", setf("tau", INT64_MAX)),
        ("metadata.epoch", "epoch+1", "past", setf("epoch", lambda live: live.get("epoch", 1) + 1)),
        ("metadata.epoch", "int64_max", "past", setf("epoch", INT64_MAX)),
        ("metadata.snapshot", "int64_max", "past", setf("snapshot", INT64_MAX)),
        ("metadata.data", "256 chars", "at", setf("data", "d" * 256)),
        ("metadata.data", "257 chars", "past", setf("data", "d" * 257)),
        ("metadata.region", "257 chars", "past", setf("region", "r" * 257)),
        ("metadata.region", "unicode", "at", setf("region", "régïon-\u2603")),
        ("metadata.loss", "1e308", "at", setf("loss", 1e308)),
        ("metadata.loss", "-1", "at", setf("loss", -1.0)),
        ("metadata.tokens", "int64_max", "past", setf("tokens", INT64_MAX)),
        ("metadata.recovering", "1", "past", setf("recovering", 1)),
        ("metadata", "unknown field", "past", lambda meta, live: {**meta, "evil": 1}),
        ("metadata", "missing step", "past", lambda meta, live: {k: v for k, v in meta.items() if k != "step"}),
        ("metadata", "not an object", "past", lambda meta, live: [1, 2, 3]),
        ("metadata", "valid", "valid", lambda meta, live: meta),
    ]
    return out


def _metadata_case(ctx: Context, i: int, mutation, cred="own", sender=None, header_sender=None,
                   fragment=0) -> Case:
    field, value, limit, mutate = mutation
    sender = learner_node(ATTACKER) if sender is None else sender  # "" is a sender to try, not a default
    header_sender = sender if header_sender is None else header_sender
    base = valid_metadata(ctx, ATTACKER)
    expect = "either" if limit in ("at", "valid") else "refuse"
    if sender != learner_node(ATTACKER) or header_sender != learner_node(ATTACKER) or cred in ("none", "wrong"):
        expect = "refuse"
    if cred == "run":
        expect = "refuse"  # run token with per-learner tokens on; the driver relabels it for shared-token runs
    return Case(i, "Metadata", field, value, limit, cred, sender, header_sender, expect,
                lambda live: frame_bytes(sender, fragment, mutate(base, live)))


IMPERSONATED = [learner_node(0), learner_node(1), learner_node(3), learner_node(10 ** 6), "syncer", "", "learner-01",
                "learner-0 ", "Learner-0", "learner-\u0661", "x" * 257, "learner-2\x00", "\U0001F600"]


def _identity_cases(ctx: Context, start: int) -> list[Case]:
    """Declared senders that are not the credential's, with valid and with past-limit content."""
    out, i = [], start
    valid = next(m for m in _metadata_mutations(ctx) if m[2] == "valid")
    poison = next(m for m in _metadata_mutations(ctx) if m[1] == "steps")
    for sender in IMPERSONATED:
        for mutation in (valid, poison):
            out.append(_metadata_case(ctx, i, mutation, sender=sender))
            i += 1
    for honest in HONEST:  # the call says learner-2 (its credential), the frame says an honest learner
        out.append(_metadata_case(ctx, i, valid, sender=learner_node(honest), header_sender=learner_node(ATTACKER)))
        out.append(_metadata_case(ctx, i + 1, valid, sender=learner_node(ATTACKER),
                                  header_sender=learner_node(honest)))
        i += 2
    for cred in ("none", "wrong", "run"):
        out.append(_metadata_case(ctx, i, valid, cred=cred))
        out.append(_metadata_case(ctx, i + 1, valid, cred=cred, sender=learner_node(0)))
        i += 2
    return out


def _wire_cases(ctx: Context, start: int) -> list[Case]:
    """Malformed transport messages: the transport decoder's limits."""
    me = learner_node(ATTACKER)
    good = frame_bytes(me, 0, valid_metadata(ctx, ATTACKER))
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    bad_magic = b"EVIL" + good[4:]
    bad_version = good[:4] + bytes([wire.WIRE_VERSION + 1]) + good[5:]
    bad_kind = good[:5] + bytes([99]) + good[6:]
    bad_flags = good[:6] + b"\x01\x00" + good[8:]
    deep = {"a": 1}
    for _ in range(40):
        deep = {"a": deep}
    raws = [
        ("wire.checksum", "flipped", bytes(flipped)),
        ("wire.magic", "EVIL", bad_magic),
        ("wire.version", "+1", bad_version),
        ("wire.kind", "99", bad_kind),
        ("wire.flags", "1", bad_flags),
        ("wire.length", "truncated", good[:-5]),
        ("wire.length", "empty", b""),
        ("wire.header", "not json", raw_message(wire.Kind.FRAME, "{not json")),
        ("wire.header", "NaN", raw_message(wire.Kind.FRAME, '{"sender":"%s","fragment":0,"meta":{"x":NaN}}' % me)),
        ("wire.header", "lone surrogate", raw_message(wire.Kind.FRAME,
                                                      '{"sender":"\\ud800","fragment":0,"meta":{}}')),
        ("wire.header", "deep meta", raw_message(wire.Kind.FRAME, {"sender": me, "fragment": 0, "meta": deep})),
        ("wire.kind", "Ack as request", wire.encode_message(wire.Ack(sender=me))),
        ("wire.payload", "metadata payload", frame_bytes(me, 0, valid_metadata(ctx, ATTACKER), b"x" * 100)),
        ("metadata.fragment", "1", frame_bytes(me, 1, valid_metadata(ctx, ATTACKER))),
        ("wire.header", "fragment 2**63", raw_message(wire.Kind.FRAME, {"sender": me, "fragment": 1 << 63,
                                                                         "meta": valid_metadata(ctx, ATTACKER)})),
    ]
    return [Case(start + k, "Metadata", field, value, "past", "own", me, me, "refuse", lambda live, d=data: d)
            for k, (field, value, data) in enumerate(raws)]


def _upload_mutations(ctx: Context) -> list[tuple[str, str, str, Callable[[dict, dict], dict], str]]:
    """(field, value, limit, mutate(meta, live), payload kind) for FragmentUpload frames of learner-2."""
    S = ctx.steps

    def setf(name, value):
        return lambda meta, live: {**meta, name: value(live) if callable(value) else value}

    cur = lambda live: live.get("versions", [0])[0]  # noqa: E731
    return [
        ("upload.base_version", "current+1000", "past", setf("base_version", lambda live: cur(live) + 1000), "zero"),
        ("upload.base_version", "int64_max", "past", setf("base_version", INT64_MAX), "zero"),
        ("upload.base_version", "2**63", "past", setf("base_version", 1 << 63), "zero"),
        ("upload.base_version", "current-5", "at", setf("base_version", lambda live: max(0, cur(live) - 5)), "zero"),
        ("upload.due_step", "steps+100", "past", setf("due_step", S + 100), "zero"),
        ("upload.due_step", "int64_max", "past", setf("due_step", INT64_MAX), "zero"),
        ("upload.c_tokens", "int64_max", "past", setf("c_tokens", INT64_MAX), "zero"),
        ("upload.c_steps", "int64_max", "past", setf("c_steps", INT64_MAX), "zero"),
        ("upload.clock", "syncer 2**53", "past", setf("clock", {"syncer": MAX_CLOCK, learner_node(ATTACKER): 1}), "zero"),
        ("upload.clock", "self 2**53+1", "past", setf("clock", {learner_node(ATTACKER): MAX_CLOCK + 1}), "zero"),
        ("upload.epoch", "epoch+1", "past", setf("epoch", lambda live: live.get("epoch", 1) + 1), "zero"),
        ("upload.epoch", "int64_max", "past", setf("epoch", INT64_MAX), "zero"),
        ("upload.final", "true mid-run", "at", setf("final", True), "zero"),
        ("upload.fragment", "P", "past", lambda meta, live: meta, "fragment_P"),
        ("upload.payload", "garbage", "past", lambda meta, live: meta, "garbage"),
        ("upload.payload", "truncated", "past", lambda meta, live: meta, "truncated"),
        ("upload.payload", "huge delta", "past", lambda meta, live: meta, "huge"),
        ("upload.payload", "zero delta", "at", lambda meta, live: meta, "zero"),
        ("upload.donation", "to learner-0", "past", lambda meta, live: meta, "donation0"),
        ("upload", "unknown field", "past", lambda meta, live: {**meta, "evil": 1}, "zero"),
    ]


def _upload_case(ctx: Context, i: int, mutation, sender: str | None = None) -> Case:
    field, value, limit, mutate, payload = mutation
    sender = learner_node(ATTACKER) if sender is None else sender
    expect = "either" if limit == "at" and sender == learner_node(ATTACKER) else "refuse"

    def build(live: dict) -> bytes:
        version = live.get("versions", [0])[0]
        meta = {"due_step": max(8, live.get("global_step", 0)), "base_version": version, "c_steps": 8,
                "c_tokens": 8 * 128, "clock": {learner_node(ATTACKER): 1}, "region": "", "final": False,
                "epoch": live.get("epoch", 1)}
        if payload == "donation0":
            donation = {"recipient": 0, "versions": [version] * ctx.fragments, "offset": 0, "total_bytes": 64,
                        "digest": "0" * 16}
            return frame_bytes(sender, 0, {"donation": donation}, b"x" * 64)
        fragment = ctx.fragments if payload == "fragment_P" else 0
        return frame_bytes(sender, fragment, mutate(meta, live), live["payloads"][payload])

    return Case(i, "Upload", field, value, limit, "own", sender, sender, expect, build)


def _bulk_cases(ctx: Context, start: int) -> list[Case]:
    me = learner_node(ATTACKER)
    names = [
        ("bulk.name", f"fragment/{ctx.fragments}", "past", me), ("bulk.name", "../../etc/passwd", "past", me),
        ("bulk.name", "fragment/-1", "past", me), ("bulk.name", "fragment/01", "at", me),
        ("bulk.name", "x" * 256, "past", me), ("bulk.name", "donation/0", "past", me),
        ("bulk.name", "position/0", "past", me), ("bulk.sender", "position/0 as learner-0", "identity", learner_node(0)),
        ("bulk.sender", "donation/1 as learner-1", "identity", learner_node(1)),
        ("bulk.offset", "past end", "past", me), ("bulk.etag", "wrong", "past", me),
        ("bulk.name", "fragment/0", "at", me),
    ]
    out = []
    for k, (field, value, limit, sender) in enumerate(names):
        name = value.split(" as ")[0] if field == "bulk.sender" else value
        offset = 1 << 40 if field == "bulk.offset" else (5 if field == "bulk.etag" else 0)
        name = "fragment/0" if field in ("bulk.offset", "bulk.etag") else name
        etag = "0" * 16 if field == "bulk.etag" else ""
        data = wire.encode_message(wire.BulkRequest(sender=sender, name=name, clock={}, offset=offset, etag=etag))
        expect = "either" if limit == "at" else "refuse"
        out.append(Case(start + k, "Bulk", field, value, limit, "own", sender, sender, expect, lambda live, d=data: d))
    return out


def _probe_cases(ctx: Context, start: int) -> list[Case]:
    me = learner_node(ATTACKER)
    values = [("probe.bytes", "max+1", ctx.max_probe_bytes + 1, "past"), ("probe.bytes", "-1", -1, "past"),
              ("probe.bytes", "'x'", "x", "past"), ("probe.bytes", "1e300", 1e300, "past"),
              ("probe.bytes", "4096", 4096, "at")]
    return [Case(start + k, "Probe", field, label, limit, "own", me, me, "either" if limit == "at" else "refuse",
                 lambda live, v=v: frame_bytes(me, 0, {"bytes": v}))
            for k, (field, label, v, limit) in enumerate(values)]


def _subscribe_cases(ctx: Context, start: int) -> list[Case]:
    out = []
    for k, (sender, limit) in enumerate([(learner_node(0), "identity"), (learner_node(1), "identity"),
                                         (learner_node(3), "past"), ("syncer", "identity"),
                                         (learner_node(ATTACKER), "at")]):
        data = wire.encode_message(wire.Subscribe(sender=sender, region="evil", instance="mallory" + str(k)))
        out.append(Case(start + k, "Subscribe", "subscribe.sender", sender, limit, "own", sender, sender,
                        "either" if limit == "at" else "refuse", lambda live, d=data: d))
    return out


def _slow_cases(ctx: Context, start: int) -> list[Case]:
    """Uploads that announce 500 MiB, then trickle (issue case 5): invented senders and learner-2's own."""
    out = []
    for k in range(ctx.slow_streams):
        sender = learner_node(ATTACKER) if k % 2 else f"mallory-{k}"
        head = wire.PRELUDE.pack(wire.MESSAGE_MAGIC, wire.WIRE_VERSION, int(wire.Kind.FRAME), 0, 2, 500 << 20) + b"{}"
        own = sender == learner_node(ATTACKER)  # its own slots (max_uploads_per_sender) are its to waste
        out.append(Case(start + k, "SlowUpload", "upload.slow_stream", "500 MiB announced, 1 B/s",
                        "at" if own else "identity", "own", sender, sender, "either" if own else "refuse",
                        lambda live, h=head: h))
    return out


def generate(ctx: Context, n: int, seed: int = 0) -> Iterator[Case]:
    """``n`` cases: every family once in order (so a short run covers each field), then drawn at random
    with the families' weights. Deterministic for ``(ctx, n, seed)``."""
    rng = random.Random(seed)
    meta_mut = _metadata_mutations(ctx)
    up_mut = _upload_mutations(ctx)

    def families(i: int) -> list[Case]:
        cases = [_metadata_case(ctx, i + k, m) for k, m in enumerate(meta_mut)]
        cases += _identity_cases(ctx, i + len(cases))
        cases += _wire_cases(ctx, i + len(cases))
        cases += [_upload_case(ctx, i + len(cases) + k, m) for k, m in enumerate(up_mut)]
        cases += [_upload_case(ctx, i + len(cases) + k, up_mut[-3], sender=s)
                  for k, s in enumerate((learner_node(0), learner_node(1)))]
        cases += _bulk_cases(ctx, i + len(cases))
        cases += _probe_cases(ctx, i + len(cases))
        cases += _subscribe_cases(ctx, i + len(cases))
        return cases

    first = families(0)
    slow = _slow_cases(ctx, 0)
    emitted = 0
    for case in first[:n]:
        yield case
        emitted += 1
    # Slow streams once, early: each holds a server slot for seconds, more add nothing but wall time.
    for case in slow[: max(0, min(len(slow), n - emitted))]:
        yield dataclasses.replace(case, i=emitted)
        emitted += 1
    # Then at random, weighted towards the cheap unary calls (what a flood is made of).
    pool = [c for c in first if c.rpc == "Metadata"] * 4 + [c for c in first if c.rpc == "Upload"] + \
        [c for c in first if c.rpc in ("Bulk", "Probe")] + [c for c in first if c.rpc == "Subscribe"][:2]
    while emitted < n:
        yield dataclasses.replace(rng.choice(pool), i=emitted)
        emitted += 1
