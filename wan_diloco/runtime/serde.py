"""Core protocol messages <-> transport frames, by one generic rule; nothing else.

The core's message table (``core.messages``) is the only schema: this module
defines no message of its own (the names it re-exports, ``Identity``,
``Donation``... are the core's). A message becomes one ``transport.Frame``:

- ``sender``: ``learner_node(m.learner)`` for a learner's message, ``SYNCER``
  for a GlobalUpdate; ``learner`` is recovered from it on decode.
- ``fragment``: the message's fragment (the fan-out's drop-to-latest key), 0 for
  Metadata.
- ``payload``: the codec's bytes, ``msg.payload``.
- ``meta``: every other field, in JSON form (VectorClock as its dict, tuples as
  lists, ``held_s`` keys as strings). The tensors (``delta`` / ``update``) come
  from decoding the payload, ``nbytes`` is its length.

On the Upload RPC, which carries fragments and donation parts, ``meta.kind``
(the table's kind: ``upload`` or ``donation``) says which; a frame without it
is told apart the old way (``meta.donation`` present: a donation part).

Decoding checks every meta field against the dataclass's annotation (see
``serde_fields``), refuses missing and unknown fields, and raises ``ProtocolError``
naming the message kind and the field in its text ("Metadata.step: ...") and
in ``.field`` (the table's ``<kind>.<field>``, e.g. "metadata.step"; "frame"
where no one field is to blame); it builds nothing until all is valid,
so malformed input changes no state. Decoded messages carry ``payload=None``:
the bytes were consumed by the codec and are not kept alive with the message.

Tensor names and shapes never travel: both ends derive the fragment layout from
the same model config, and the codec checks a payload against it.
"""
from __future__ import annotations

import re
import typing
from typing import Any, Mapping, Union

import numpy as np

from wan_diloco import transport
from wan_diloco.compression.coded import Coded
from wan_diloco.compression.fragment import Decoded
from wan_diloco.core import fingerprint
from wan_diloco.core.recovery import (  # noqa: F401 - importable from serde as before
    DONATION_PART_BYTES, donation_parts, max_state_bytes, state_digest,
)
from wan_diloco.core.messages import (  # noqa: F401 - the table's names, importable from serde as before
    KIND_OF, MAX_INT, MAX_LEARNERS, MAX_STR_CHARS, PROTOCOL_VERSION, SYNCER, Barrier, BulkFragment, BulkHeader,
    Donate, Donation, FragmentUpload, GlobalUpdate, Identity, Metadata, ProtocolError, SnapshotCut, learner_node,
)
from wan_diloco.runtime.serde_fields import ID, is_int, plain, schema

Message = Union[Metadata, FragmentUpload, GlobalUpdate]
_Bulk = BulkHeader  # its old name here

_DIGEST = re.compile(r"[0-9a-f]{16}")
_LEARNER = re.compile(rf"learner-({ID.pattern})")


_SCHEMAS = {cls: schema(cls) for cls in (Metadata, FragmentUpload, GlobalUpdate)}


# Update-stream frames that are not GlobalUpdates, by their table kind.
_CONTROL = {KIND_OF[cls]: cls for cls in (Identity, Donate, Barrier, SnapshotCut)}
DONATE_KEY = 1 << 30  # fan-out key of Donate frames (+ recipient): never a fragment, never dropped for one
BARRIER_KEY = DONATE_KEY - 1  # fan-out key of Barrier frames: a newer one replaces an older, never an update
CUT_KEY = DONATE_KEY - 2  # fan-out key of SnapshotCut frames: a newer cut replaces an older (its part covers it)
_KEYS = {Barrier: BARRIER_KEY, SnapshotCut: CUT_KEY, Identity: 0}
for _cls in (Identity, Donate, Donation, Barrier, SnapshotCut, BulkHeader):
    _SCHEMAS[_cls] = schema(_cls)


_NAMES = {BulkHeader: "Bulk"}  # what refusal texts call it
UPLOAD_KINDS = ("upload", "donation")  # the table kinds the Upload RPC carries, named in ``meta.kind``


def _name(cls: type) -> str:
    return _NAMES.get(cls, cls.__name__)


def _refusal(cls: type, name: str, text: str) -> ProtocolError:
    """"Metadata.step: text", field "metadata.step" (the table's kind and the field)."""
    return ProtocolError(f"{_name(cls)}.{name}: {text}", f"{KIND_OF[cls]}.{name}")


def _frame_refusal(cls: type, text: str) -> ProtocolError:
    """A frame of ``cls`` malformed as a whole, not in one field: field "frame"."""
    return ProtocolError(f"{_name(cls)}: {text}", "frame")


def _meta_of(msg: Any) -> dict[str, Any]:
    cls = type(msg)
    meta = {f.name: f.to_json(getattr(msg, f.name)) for f in _SCHEMAS[cls]}
    # Validate on the way out too: never send what a receiver would refuse.
    _fields_of(cls, meta)
    return meta


def _fields_of(cls: type, meta: Any) -> dict[str, Any]:
    """The dataclass's meta fields from ``meta``, validated; ProtocolError names the first problem."""
    if not isinstance(meta, Mapping):
        raise _frame_refusal(cls, f"meta must be an object, got {type(meta).__name__}")
    schema = _SCHEMAS[cls]
    names = {f.name for f in schema}
    unknown, missing = sorted(str(k) for k in set(meta) - names), [f.name for f in schema if f.name not in meta]
    if unknown:
        # Counted as "<kind>.unknown": a peer's made-up names must not become /metrics labels.
        raise ProtocolError(f"{_name(cls)}.{unknown[0][:40]}: unknown field", f"{KIND_OF[cls]}.unknown")
    if missing:
        raise _refusal(cls, missing[0], "missing")
    out = {}
    for f in schema:
        try:
            out[f.name] = f.from_json(meta[f.name])
        except ValueError as e:
            raise _refusal(cls, f.name, str(e)) from None
    return out


def _without_kind(cls: type, meta: Any) -> Any:
    """An Upload RPC frame's ``meta`` without its ``kind``, which must name ``cls`` if it is there."""
    if not (isinstance(meta, Mapping) and "kind" in meta):
        return meta  # a frame from before the table named its kind
    if meta["kind"] != KIND_OF[cls]:
        raise _refusal(cls, "kind", f"expected {KIND_OF[cls]!r}, got {str(meta['kind'])[:40]!r}")
    return {k: v for k, v in meta.items() if k != "kind"}


# ---- public ---------------------------------------------------------------------------


def learner_id(sender: str, num_learners: int) -> int:
    """``learner-N`` -> N, checked against the run's learner count; ProtocolError otherwise."""
    match = _LEARNER.fullmatch(sender) if isinstance(sender, str) else None
    if match is None or not int(match.group(1)) < num_learners:
        raise ProtocolError(f"sender {str(sender)[:40]!r} is not a learner of this run "
                            f"(learner-0..learner-{num_learners - 1})", "sender")
    return int(match.group(1))


def to_frame(msg: Message) -> transport.Frame:
    """The frame carrying ``msg`` (see the module docstring). ProtocolError if a field
    is out of range, or if there is no payload to send."""
    cls = type(msg)
    if cls not in (Metadata, FragmentUpload, GlobalUpdate):
        raise TypeError(f"to_frame takes Metadata, FragmentUpload or GlobalUpdate, got {cls.__name__}")
    sender = SYNCER if cls is GlobalUpdate else learner_node(_check_int_field(cls, "learner", msg.learner))
    fragment, payload = 0, b""
    if cls is not Metadata:
        fragment = _check_int_field(cls, "fragment", msg.fragment)
        if msg.payload is None:
            raise _refusal(cls, "payload", f"none to send (fragment {fragment})")
        payload = msg.payload
    meta = _meta_of(msg)
    if cls is FragmentUpload:  # the Upload RPC also carries donation parts: say which this is
        meta = {"kind": KIND_OF[cls], **meta}
    return transport.Frame(sender, fragment, meta, payload)


def metadata_from_frame(frame: transport.Frame, num_learners: int) -> Metadata:
    """A learner's Metadata from its frame (the Metadata RPC)."""
    learner = _learner_of(Metadata, frame.sender, num_learners)
    # Another protocol version first: its fields may differ, and "unknown field" would hide why.
    other = fingerprint.protocol_differs(frame.meta.get("fingerprint") if isinstance(frame.meta, Mapping) else None,
                                         PROTOCOL_VERSION)
    if other is not None:
        raise ProtocolError(f"learner {learner}: {fingerprint.SETTINGS_DIFFER}: {other}", "fingerprint")
    if frame.fragment != 0:
        raise _refusal(Metadata, "fragment", f"must be 0 (metadata is not about one fragment), got {frame.fragment}")
    if len(frame.payload):
        raise _refusal(Metadata, "payload", f"must be empty, got {len(frame.payload)} bytes")
    return Metadata(learner=learner, **_fields_of(Metadata, frame.meta))


def upload_from_frame(frame: transport.Frame, codec, num_learners: int) -> FragmentUpload:
    """A learner's FragmentUpload from its frame; ``codec.decode`` gives the delta."""
    learner = _learner_of(FragmentUpload, frame.sender, num_learners)
    fields = _fields_of(FragmentUpload, _without_kind(FragmentUpload, frame.meta))
    # Kept in its codes (``compression.coded``): the syncer folds it into a round's sums straight from them.
    delta = _decode(codec, frame.fragment, frame.payload, deferred=True)
    if isinstance(delta, (Decoded, Coded)):
        delta.handed_over = True  # decoded for this upload alone: the syncer drops it once folded
    return FragmentUpload(learner=learner, fragment=frame.fragment, delta=delta, nbytes=len(frame.payload),
                          payload=None, **fields)


def update_from_frame(frame: transport.Frame, codec) -> GlobalUpdate:
    """The syncer's GlobalUpdate from its frame; ``codec.decode`` gives the update."""
    if frame.sender != SYNCER:
        raise _refusal(GlobalUpdate, "sender", f"expected {SYNCER!r}, got {frame.sender[:40]!r}")
    fields = _fields_of(GlobalUpdate, frame.meta)
    update = _decode(codec, frame.fragment, frame.payload)
    return GlobalUpdate(fragment=frame.fragment, update=update, nbytes=len(frame.payload), payload=None, **fields)


def control_to_frame(msg: Identity | Donate | Barrier | SnapshotCut) -> transport.Frame:
    """The update-stream frame of a control message (``Identity``, ``Donate``, ``Barrier`` or ``SnapshotCut``)."""
    key = DONATE_KEY + msg.recipient if isinstance(msg, Donate) else _KEYS[type(msg)]
    return transport.Frame(SYNCER, key, {KIND_OF[type(msg)]: _meta_of(msg)})


def control_from_frame(frame: transport.Frame) -> Identity | Donate | Barrier | SnapshotCut | None:
    """The control message an update-stream frame carries, or None for a GlobalUpdate's frame."""
    meta = frame.meta
    names = [k for k in _CONTROL if isinstance(meta, Mapping) and k in meta]
    if not names:
        return None
    if frame.sender != SYNCER or len(meta) != 1 or len(frame.payload):
        raise _frame_refusal(_CONTROL[names[0]], f"a frame from the syncer with only meta.{names[0]} and no "
                                                 f"payload expected")
    msg = _CONTROL[names[0]](**_fields_of(_CONTROL[names[0]], meta[names[0]]))
    if isinstance(msg, Donate) and not (msg.recipient < MAX_LEARNERS and frame.fragment == DONATE_KEY + msg.recipient):
        raise ProtocolError(f"Donate: recipient {msg.recipient} and fan-out key {frame.fragment} do not match",
                            "donate.recipient")
    return msg


def donation_to_frame(donor: int, msg: Donation, payload: bytes) -> transport.Frame:
    """The Upload RPC frame of one donation part (``meta.kind`` "donation")."""
    return transport.Frame(learner_node(donor), 0, {"kind": KIND_OF[Donation], **_meta_of(msg)}, payload)


def donation_frames(donor: int, recipient: int, versions: tuple[int, ...], state: bytes,
                    part_bytes: int = DONATION_PART_BYTES) -> typing.Iterator[transport.Frame]:
    """A donor's ``state`` for ``recipient`` as the frames of its parts (``core.recovery.donation_parts``), in order."""
    for msg, payload in donation_parts(recipient, versions, state, part_bytes):
        yield donation_to_frame(donor, msg, payload)


# XXH3-64 (hex) of bytes: a donated state's check once all its parts arrived, and a bulk object's etag
# (a broken fetch resumes only into the same bytes). One digest, the core's.
bytes_digest = state_digest


def donation_from_frame(frame: transport.Frame, num_learners: int) -> tuple[int, Donation] | None:
    """(donor, Donation) of a donor's upload, or None for a FragmentUpload's frame (``meta.kind`` other
    than "donation"; ``upload_from_frame`` checks it); the payload stays in the frame (the recipient
    decodes it). A frame without ``meta.kind`` is a donation part if it has ``meta.donation`` (the form
    before the table named kinds): both are accepted."""
    meta = frame.meta
    if not isinstance(meta, Mapping):
        return None
    if meta.get("kind") == KIND_OF[Donation]:
        fields = {k: v for k, v in meta.items() if k != "kind"}
    elif "kind" not in meta and "donation" in meta:
        if len(meta) != 1:
            raise _frame_refusal(Donation, "only meta.donation and fragment 0 expected")
        fields = meta["donation"]
    else:
        return None
    donor = _learner_of(Donation, frame.sender, num_learners)
    if frame.fragment != 0:
        raise _frame_refusal(Donation, "only meta.donation and fragment 0 expected")
    msg = Donation(**_fields_of(Donation, fields))
    if not msg.recipient < num_learners or msg.recipient == donor:
        raise _refusal(Donation, "recipient", f"{msg.recipient} is not another learner of this run")
    if not (len(frame.payload) and msg.offset + len(frame.payload) <= msg.total_bytes):
        raise _frame_refusal(Donation, f"a part of {len(frame.payload)} bytes at offset {msg.offset} does not fit "
                                       f"a state of {msg.total_bytes} bytes")
    if not _DIGEST.fullmatch(msg.digest):
        raise _refusal(Donation, "digest", f"expected 16 lowercase hex digits (XXH3-64), got {msg.digest[:40]!r}")
    return donor, msg


def fragment_to_bulk(fragment: int, version: int, global_step: int, values: Mapping[str, np.ndarray],
                     codec, run_id: str = "", epoch: int = 0, resumed_from: int = 0) -> bytes:
    """One self-contained bulk object for a global fragment (rejoin, resync, final fetch).

    Pass a lossless codec (``CodecConfig(bits=32, zstd=False)``): the object is a
    transport message (one header with fragment, version and global step, one
    checksum) whose payload is ``codec.encode(values)``.
    """
    meta = _meta_of(BulkHeader(version, global_step, run_id, epoch, resumed_from))
    try:
        payload = codec.encode(values)
    except ValueError as e:
        raise ProtocolError(f"bulk fragment {fragment}: {e}", "frame") from None
    try:
        return transport.encode_message(transport.Frame(SYNCER, fragment, meta, payload))
    except transport.MessageError as e:
        raise ProtocolError(f"bulk fragment {fragment}: {e}", "frame") from None


def fragment_from_bulk(data: Any, codec) -> BulkFragment:
    """The fragment of a bulk object; ``values`` are owned, writable copies (nothing refers to
    ``data`` afterwards)."""
    try:
        # The caller already holds all of ``data`` (the fetch bounded it): no further cap here.
        frame = transport.decode_message(data, max_bytes=len(memoryview(data).cast("B")))
    except (transport.MessageError, TypeError) as e:
        raise ProtocolError(f"bulk object: {e}", "frame") from None
    if not isinstance(frame, transport.Frame):
        raise ProtocolError(f"bulk object: expected a Frame, got {type(frame).__name__}", "frame")
    fields = _fields_of(BulkHeader, frame.meta)
    values = _decode(codec, frame.fragment, frame.payload)
    return BulkFragment(frame.fragment, fields["version"], fields["global_step"],
                        {n: np.array(a) for n, a in values.items()}, fields["run_id"], fields["epoch"],
                        fields["resumed_from"])


# ---- helpers --------------------------------------------------------------------------


def _check_int_field(cls: type, name: str, value: Any) -> int:
    value = plain(value)
    if not is_int(value):
        raise _refusal(cls, name, f"expected a non-negative integer, got {value!r}")
    return value


def _learner_of(cls: type, sender: str, num_learners: int) -> int:
    try:
        return learner_id(sender, num_learners)
    except ProtocolError as e:
        raise _refusal(cls, "sender", str(e)) from None


def _decode(codec, fragment: int, payload: Any, deferred: bool = False) -> Mapping[str, np.ndarray]:
    """``codec.decode`` with a refusal (any ValueError, e.g. CodecError) as a ProtocolError."""
    try:
        return codec.decode(fragment, payload, deferred=True) if deferred else codec.decode(fragment, payload)
    except ProtocolError as e:
        e.field = e.field or "frame"
        raise
    except ValueError as e:
        text = str(e)
        raise ProtocolError(text if text.startswith(f"fragment {fragment}:") else f"fragment {fragment}: {text}",
                            "frame") from None
