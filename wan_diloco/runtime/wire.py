"""Core messages <-> transport messages, and the fragment codec.

The transport carries opaque payloads. Ours is an *envelope*: a little-endian
u32 length, a small JSON object with the protocol fields the transport schema
has no slot for (the due step of an upload, the source version and
contributors of an update, the version of a bulk fragment), then the codec's
bytes. Tensor names and shapes are never sent: both ends derive the fragment
layout from the same model config, so the payload of fragment p is its
tensors' values in the fragment's name order.

The codec is pluggable (:class:`WireCodec`): ``roundtrip`` is the cores'
``Codec`` protocol with ``payload`` set, ``decode`` turns a payload of fragment
p back into tensors. :class:`Float32Wire` is the uncompressed codec.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core import Encoded, FragmentUpload, GlobalUpdate, Metadata, ProtocolError, learner_node
from wan_diloco.core.protocol import SYNCER
from wan_diloco import transport as tp

_LEN = struct.Struct("<I")
MAX_ENVELOPE_HEADER_BYTES = 1 << 16


class WireCodec(Protocol):
    def roundtrip(self, values: Mapping[str, np.ndarray]) -> Encoded:
        """Encode one fragment's tensors; ``payload`` holds the bytes, ``values`` what decode gives."""

    def decode(self, fragment: int, payload: Any) -> dict[str, np.ndarray]:
        """Tensors of ``fragment`` from a payload; ProtocolError if it does not fit the layout."""


class Layout:
    """Names and shapes of every fragment, derived from the model config on both ends."""

    def __init__(self, fragments: Sequence[Sequence[str]], shapes: Mapping[str, tuple[int, ...]]):
        self.fragments = [tuple(f) for f in fragments]
        self.shapes = {n: tuple(shapes[n]) for f in self.fragments for n in f}
        self.fragment_of = {n: p for p, f in enumerate(self.fragments) for n in f}
        self.nbytes = [4 * sum(math.prod(self.shapes[n]) for n in f) for f in self.fragments]

    def fragment_for(self, names: Sequence[str]) -> int:
        names = list(names)
        if not names or names[0] not in self.fragment_of:
            raise ProtocolError(f"tensors {names[:2]} belong to no fragment")
        p = self.fragment_of[names[0]]
        if set(names) != set(self.fragments[p]):
            raise ProtocolError(f"tensors do not form fragment {p}")
        return p


class Float32Wire:
    """Uncompressed: float32 little-endian values of the fragment's tensors, concatenated in name order."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def roundtrip(self, values: Mapping[str, np.ndarray]) -> Encoded:
        p = self.layout.fragment_for(list(values))
        parts, out = [], {}
        for n in self.layout.fragments[p]:
            a = np.ascontiguousarray(values[n], dtype="<f4")
            if a.shape != self.layout.shapes[n]:
                raise ProtocolError(f"{n!r}: shape {a.shape}, expected {self.layout.shapes[n]}")
            if not np.all(np.isfinite(a)):
                raise ProtocolError(f"tensor {n!r} has NaN or Inf values; refusing to send it")
            out[n] = a.copy()
            parts.append(out[n].tobytes())
        payload = b"".join(parts)
        return Encoded(values=out, nbytes=len(payload), payload=payload)

    def decode(self, fragment: int, payload: Any) -> dict[str, np.ndarray]:
        if not 0 <= fragment < len(self.layout.fragments):
            raise ProtocolError(f"fragment {fragment} out of range 0..{len(self.layout.fragments) - 1}")
        view = memoryview(payload).cast("B")
        expected = self.layout.nbytes[fragment]
        if len(view) != expected:
            raise ProtocolError(f"fragment {fragment}: payload of {len(view)} bytes, expected {expected} (float32)")
        out, offset = {}, 0
        for n in self.layout.fragments[fragment]:
            shape = self.layout.shapes[n]
            count = math.prod(shape)
            # A view of the transport's buffer, no copy; numpy keeps the buffer alive.
            a = np.frombuffer(view, dtype="<f4", count=count, offset=offset).reshape(shape)
            if not np.all(np.isfinite(a)):
                raise ProtocolError(f"fragment {fragment}: {n!r} has NaN or Inf values")
            out[n] = a
            offset += 4 * count
        return out


class CompressedWire:
    """int8 / NF4 / bf16 outer gradients and updates through the wire codec (wan_diloco.compression)."""

    def __init__(self, layout: Layout, cfg):
        from wan_diloco.compression.fragment_codec import FragmentCodec

        self.layout = layout
        self._codec = FragmentCodec(cfg)

    def roundtrip(self, values: Mapping[str, np.ndarray]) -> Encoded:
        self.layout.fragment_for(list(values))
        return self._codec.roundtrip(values)

    def decode(self, fragment: int, payload: Any) -> dict[str, np.ndarray]:
        from wan_diloco.compression import CodecError, decode

        if not 0 <= fragment < len(self.layout.fragments):
            raise ProtocolError(f"fragment {fragment} out of range 0..{len(self.layout.fragments) - 1}")
        try:
            # No honest encoding of fragment p is larger than its fp32 size plus headers.
            out = decode(bytes(payload), max_bytes=2 * self.layout.nbytes[fragment] + (1 << 16))
        except CodecError as e:
            raise ProtocolError(f"fragment {fragment}: {e}") from None
        if set(out) != set(self.layout.fragments[fragment]):
            raise ProtocolError(f"fragment {fragment}: payload names other tensors than the fragment's")
        for n, a in out.items():
            if a.shape != self.layout.shapes[n]:
                raise ProtocolError(f"{n!r}: shape {a.shape}, expected {self.layout.shapes[n]}")
        return out


def make_codec(layout: Layout, cfg) -> WireCodec:
    """The codec a run's ``[codec]`` table asks for; 32 bits is the uncompressed fp32 path."""
    return Float32Wire(layout) if cfg.bits == 32 else CompressedWire(layout, cfg)


# ---- envelope ------------------------------------------------------------------------


def seal(fields: Mapping[str, Any], body: bytes | memoryview) -> bytes:
    """Envelope = u32 length + JSON fields + codec bytes."""
    head = json.dumps(dict(fields), separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, body))


def unseal(payload: Any, required: Mapping[str, type]) -> tuple[dict[str, Any], memoryview]:
    """(fields, body view) of an envelope; every field in ``required`` must be there with its type."""
    view = memoryview(payload).cast("B")
    if len(view) < _LEN.size:
        raise ProtocolError(f"payload of {len(view)} bytes is too short for an envelope")
    (hlen,) = _LEN.unpack_from(view)
    if hlen > MAX_ENVELOPE_HEADER_BYTES or _LEN.size + hlen > len(view):
        raise ProtocolError(f"envelope header of {hlen} bytes does not fit the {len(view)}-byte payload")
    try:
        fields = json.loads(bytes(view[_LEN.size : _LEN.size + hlen]))
    except ValueError as e:
        raise ProtocolError(f"envelope header is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("envelope header must be a JSON object")
    for name, typ in required.items():
        v = fields.get(name)
        if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
            raise ProtocolError(f"envelope field {name!r}: expected {typ.__name__}, got {v!r}")
    return fields, view[_LEN.size + hlen :]


def learner_id(sender: str, num_learners: int) -> int:
    """``learner-N`` -> N, checked against the run's learner count."""
    prefix = learner_node(0)[:-1]
    tail = sender[len(prefix):] if sender.startswith(prefix) else ""
    if not tail.isdigit() or not 0 <= int(tail) < num_learners:
        raise ProtocolError(f"sender {sender!r} is not a learner of this run (learner-0..learner-{num_learners - 1})")
    return int(tail)


def _clock(entries: Mapping[str, int]) -> VectorClock:
    try:
        return VectorClock.from_dict(entries)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


# ---- conversions ---------------------------------------------------------------------


def metadata_to_wire(m: Metadata) -> tp.Metadata:
    return tp.Metadata(learner_node(m.learner), m.region, m.step, m.c_steps, m.c_tokens, m.clock.to_dict())


def metadata_from_wire(m: tp.Metadata, num_learners: int, step_s: float | None, sync_s: float | None) -> Metadata:
    return Metadata(learner_id(m.sender, num_learners), m.step, m.fragment_steps, m.fragment_tokens,
                    _clock(m.clock), step_s, sync_s, m.region)


def upload_to_wire(u: FragmentUpload, final: bool = False, extra: Mapping[str, Any] | None = None) -> tp.FragmentUpload:
    fields = {"due_step": u.due_step, "final": final, **(extra or {})}
    return tp.FragmentUpload(learner_node(u.learner), u.region, u.fragment, u.base_version, u.c_steps, u.c_tokens,
                             u.clock.to_dict(), seal(fields, u.payload))


def upload_from_wire(m: tp.FragmentUpload, codec: WireCodec, num_learners: int) -> tuple[FragmentUpload, dict]:
    """(core upload, envelope fields); ProtocolError names what is wrong."""
    learner = learner_id(m.sender, num_learners)
    fields, body = unseal(m.payload, {"due_step": int, "final": bool})
    delta = codec.decode(m.fragment, body)
    up = FragmentUpload(learner, m.fragment, fields["due_step"], m.base_version, m.steps, m.tokens,
                        _clock(m.clock), delta, len(body), region=m.region)
    return up, fields


def update_to_wire(u: GlobalUpdate) -> tp.GlobalUpdate:
    fields = {"from_version": u.from_version, "due_step": u.due_step, "contributors": list(u.contributors),
              "held_s": {str(k): v for k, v in u.held_s.items()}}
    return tp.GlobalUpdate(SYNCER, u.fragment, u.to_version, u.global_step, u.clock.to_dict(), seal(fields, u.payload))


def update_from_wire(m: tp.GlobalUpdate, codec: WireCodec) -> GlobalUpdate:
    fields, body = unseal(m.payload, {"from_version": int, "due_step": int, "contributors": list, "held_s": dict})
    try:
        held = {int(k): float(v) for k, v in fields["held_s"].items()}
    except (TypeError, ValueError):
        raise ProtocolError("envelope field 'held_s': expected learner -> seconds") from None
    update = codec.decode(m.fragment, body)
    return GlobalUpdate(m.fragment, fields["from_version"], m.version, fields["due_step"], m.global_step,
                        _clock(m.clock), update, len(body), tuple(int(c) for c in fields["contributors"]), held)


def fragment_to_bulk(fragment: int, version: int, values: Mapping[str, np.ndarray], layout: Layout,
                     global_step: int) -> bytes:
    """The full fp32 global fragment (lossless whatever the update codec), for resync and rejoin."""
    enc = Float32Wire(layout).roundtrip(values)
    return seal({"fragment": fragment, "version": version, "global_step": global_step}, enc.payload)


def fragment_from_bulk(data: Any, layout: Layout) -> tuple[int, int, int, dict[str, np.ndarray]]:
    """(fragment, version, global step, values) of a bulk fragment."""
    fields, body = unseal(data, {"fragment": int, "version": int, "global_step": int})
    values = Float32Wire(layout).decode(fields["fragment"], body)
    return fields["fragment"], fields["version"], fields["global_step"], {n: a.copy() for n, a in values.items()}
