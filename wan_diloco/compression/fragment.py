"""FragmentCodec: one fragment's tensors <-> bytes, for every bit width (32 included).

Stages, each its own module: quantize (``blocks`` over ``quantize`` /
``pallas_kernels``) -> pack (``pack``: byte layout of values, scale planes,
codes) -> entropy (``entropy``: zstd) -> frame (``frame``: a fixed header).

Both ends of a run know the fragment layout, so a payload carries no names or
shapes; decode checks it against the layout and returns the right tensors
with the right shapes, or raises a CodecError naming what is wrong. The sender
decodes its own raw bytes with the same unpacker every receiver uses, so what
it accounts for (error feedback, the syncer's own Θ) is bit-identical to what
arrives everywhere.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from wan_diloco.compression import entropy, frame, pack
from wan_diloco.compression.blocks import resolve_impl
from wan_diloco.compression.config import CodecConfig, Format
from wan_diloco.compression.errors import CodecError, EncodeError
from wan_diloco.fragments import Encoded, Layout
from wan_diloco.merge import SERIAL, Workers


class Decoded(dict):
    """A decoded fragment's tensors {name: float32 array}, with ``sum_squares``: Σx² of each (float64,
    in the dict's order), computed by the decoding pass itself so the receiver's finiteness and norm
    checks need not read the values again. Set by this codec only, never taken from the wire.

    ``handed_over``: whoever decoded it says nobody else holds these tensors, so the one it hands them to
    (the syncer, once the Δ is folded into its sums) may drop them at once: ``clear()`` lets their buffer
    go back to ``buffers.POOL`` while the caller's frames still hold the dict."""

    sum_squares: np.ndarray
    handed_over: bool = False


class FragmentCodec:
    """Encodes and decodes the fragments of one :class:`Layout` with one :class:`CodecConfig`.

    ``encode``/``roundtrip`` refuse values with an EncodeError (NonFiniteError for
    NaN/Inf or overflow) naming the tensor, before producing any bytes;
    ``decode`` refuses a malformed payload with a CodecError and changes no state.
    """

    def __init__(self, cfg: CodecConfig, layout: Layout, workers: Workers = SERIAL):
        """``workers``: the threads decode and the quantizing of host arrays run their chunks on (a
        syncer's pool; the same bits on any number)."""
        cfg.validate()
        self.workers = workers
        self.cfg, self.layout = cfg, layout
        self._fmt = cfg.format
        self._impl = resolve_impl(cfg.impl)
        self._sizes = [[math.prod(layout.shapes[n]) for n in f] for f in layout.fragments]
        self._max_bytes = [frame.HEADER_BYTES + max(nbytes, pack.raw_nbytes(self._fmt, sizes))
                           for nbytes, sizes in zip(layout.nbytes, self._sizes)]

    # ------------------------------------------------------------ encode
    def encode(self, values: Mapping[str, Any], key=None) -> bytes:
        """The payload of one fragment: ``values`` maps exactly its tensor names to
        float arrays (numpy or jax, float32/bfloat16/float16) of the layout's shapes.

        ``key`` (a jax PRNG key) is required when ``cfg.stochastic_rounding`` and bits is 8 or 4.
        """
        return self._encode(values, key)[0]

    def roundtrip(self, values: Mapping[str, Any], key=None, *, in_place: bool = False) -> Encoded:
        """``encode`` plus exactly what ``decode`` gives for the payload, bit for bit. ``in_place``: the
        caller needs ``values`` no more, so the decoded values overwrite them where they are writable
        float32 numpy arrays (8/4-bit formats): no second fragment-sized buffer. Without it, host arrays
        are encoded and decoded in one pass (``_roundtrip_host``), into new arrays."""
        p, arrays = self._arrays(values)
        if not in_place and self._fused() and all(isinstance(x, np.ndarray) for x in arrays):
            return self._roundtrip_host(p, arrays)[0]
        data, p, raw = self._encode(values, key)
        into = None
        if in_place:
            flats = [values[n] for n in self.layout.fragments[p]]
            if all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable
                   for x in flats):
                into = [x.reshape(-1) for x in flats]
        return Encoded(values=self._unpack(p, self._fmt, raw, into), nbytes=len(data), payload=data)

    def roundtrip_delta(self, base: Mapping[str, Any], theta: Mapping[str, Any], plus: Mapping[str, Any] | None = None,
                        residual: bool = False) -> tuple[Encoded, dict[str, np.ndarray] | None]:
        """``roundtrip`` of Δ = base − theta (+ ``plus``), each float32 as numpy computes it, and with
        ``residual`` also Δ − decoded: a learner's outer gradient with error feedback. On the host (8 or 4
        bits, round to nearest) one pass per chunk computes Δ, quantizes, packs and decodes it, so no
        whole Δ is held; elsewhere the same arithmetic one whole array at a time (the same bits)."""
        p, thetas = self._arrays(theta)
        names = self.layout.fragments[p]
        if set(base) != set(names) or (plus is not None and set(plus) != set(names)):
            raise EncodeError(f"fragment {p}: base and residual must hold exactly its tensors")
        bases = [np.asarray(base[n], np.float32) for n in names]
        pluses = None if plus is None else [np.asarray(plus[n], np.float32) for n in names]
        for n, b, r in zip(names, bases, pluses or bases):
            if b.shape != self.layout.shapes[n] or r.shape != self.layout.shapes[n]:
                raise EncodeError(f"tensor {n!r}: base or residual shape differs from {self.layout.shapes[n]}")
        thetas = [np.asarray(x) for x in thetas]
        if self._fused():
            enc, host = self._roundtrip_host(p, bases, thetas, pluses, residual)
            shaped = {n: r.reshape(self.layout.shapes[n]) for n, r in zip(names, host.residual or [])}
            return enc, shaped if residual else None
        delta = {n: b - np.asarray(x, np.float32) for n, b, x in zip(names, bases, thetas)}
        if pluses is not None:
            delta = {n: d + r for (n, d), r in zip(delta.items(), pluses)}
        enc = self.roundtrip(delta)
        return enc, {n: d - enc.values[n] for n, d in delta.items()} if residual else None

    def _fused(self) -> bool:
        """Whether host arrays are encoded and decoded in one pass (``pack.pack_host``)."""
        return self._fmt.quantized and self._impl == "jnp" and not self.cfg.stochastic_rounding

    def _roundtrip_host(self, p: int, arrays, minus=None, plus=None, residual: bool = False):
        parts, host = pack.pack_host(self._fmt, self.layout.fragments[p], self._sizes[p], self.workers, arrays,
                                     minus, plus, residual)
        data, _ = self._frame(p, parts)
        out = Decoded()
        out.sum_squares = host.sum_squares
        for n, flat in zip(self.layout.fragments[p], host.decoded):
            a = flat.reshape(self.layout.shapes[n])
            a.flags.writeable = False  # as ``_unpack``'s: the values sent are shared
            out[n] = a
        return Encoded(values=out, nbytes=len(data), payload=data), host

    def _encode(self, values: Mapping[str, Any], key) -> tuple[bytes, int, Any]:
        """(payload, fragment index, its raw pre-zstd bytes)."""
        p, arrays = self._arrays(values)
        fmt = self._fmt
        stochastic = self.cfg.stochastic_rounding and fmt.quantized
        if stochastic and key is None:
            raise EncodeError("stochastic_rounding needs a PRNG key: encode(values, key=...)")
        parts = pack.pack(fmt, self.layout.fragments[p], arrays, impl=self._impl,
                          key=key if stochastic else None, workers=self.workers)
        data, raw = self._frame(p, parts)
        return data, p, raw

    def _frame(self, p: int, parts) -> tuple[bytes, Any]:
        """(payload, its raw pre-zstd bytes) from the packed parts: zstd (if on) and the header."""
        raw_len = sum(memoryview(a).nbytes for a in parts)
        raw = packed = None
        if self.cfg.zstd:
            # One-shot over the joined parts: twice as fast as streaming them.
            raw = b"".join(parts)
            parts = None  # the codes, joined: not held through the compress and the frame (a syncer's peak)
            packed = entropy.compress(raw, self.cfg.zstd_level)
        body = parts if raw is None else [packed if packed is not None else raw]
        header = frame.Header(self._fmt, packed is not None, p, raw_len, sum(memoryview(a).nbytes for a in body))
        data = b"".join([frame.pack_header(header), *body])
        # The sender unpacks the raw bytes, not the zstd frame: the same bits, no decompression.
        return data, memoryview(data)[frame.HEADER_BYTES:] if packed is None else raw

    def _arrays(self, values: Mapping[str, Any]) -> tuple[int, list]:
        if not isinstance(values, Mapping):
            raise EncodeError(f"values must map tensor names to arrays, got {type(values).__name__}")
        names = list(values)
        p = self.layout.fragment_of.get(names[0]) if names else None
        if p is None:
            raise EncodeError(f"tensor {names[0]!r} belongs to no fragment" if names else
                              "no tensors given: cannot tell which fragment to encode")
        want = self.layout.fragments[p]
        if len(names) != len(want) or set(names) != set(want):
            missing = [n for n in want if n not in values][:3]
            extra = [n for n in names if self.layout.fragment_of.get(n) != p][:3]
            raise EncodeError(f"fragment {p}: wrong tensor set (missing {missing}, unexpected {extra})")
        arrays = []
        for n in want:
            x = values[n]
            dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
            if (dtype.kind != "f" and dtype.name != "bfloat16") or dtype.itemsize > 4:
                raise EncodeError(f"tensor {n!r}: dtype {dtype} is not float32 (or float16/bfloat16)")
            shape = tuple(np.shape(x))
            if shape != self.layout.shapes[n]:
                raise EncodeError(f"tensor {n!r}: shape {shape}, expected {self.layout.shapes[n]}")
            arrays.append(x)
        return p, arrays

    # ------------------------------------------------------------ decode
    def decode(self, fragment: int, payload: bytes | bytearray | memoryview) -> Decoded:
        """Tensors of ``fragment`` (layout names and shapes, float32) from its payload, with their Σx².

        Without zstd, fp32 tensors are read-only views into ``payload``: do not
        mutate a buffer passed in while its tensors are in use.
        """
        try:
            self.layout.check_index(fragment)
        except ValueError as e:
            raise CodecError(str(e)) from None
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
        mv = memoryview(payload)
        if not mv.c_contiguous:
            raise CodecError("payload buffer is not contiguous")
        mv = mv.cast("B")
        if len(mv) > self._max_bytes[fragment]:
            raise CodecError(f"fragment {fragment}: payload is {len(mv)} bytes, over the limit of "
                             f"{self._max_bytes[fragment]} (its fp32 size + header)")
        h = frame.parse_header(mv)
        if h.fragment != fragment:
            raise CodecError(f"fragment index: payload is for fragment {h.fragment}, not {fragment}")
        want = pack.raw_nbytes(h.fmt, self._sizes[fragment])
        if h.raw_len != want:
            raise CodecError(f"raw_len: header says {h.raw_len} bytes, fragment {fragment} "
                             f"in {h.fmt.bits}-bit needs {want}")
        body = mv[frame.HEADER_BYTES:]
        raw = entropy.decompress(body, h.raw_len) if h.zstd else body
        return self._unpack(fragment, h.fmt, raw)

    def _unpack(self, p: int, fmt: Format, raw, into=None) -> Decoded:
        flats, sums = pack.unpack(fmt, raw, self._sizes[p], self.workers, into)
        out = Decoded()
        out.sum_squares = sums
        for n, flat in zip(self.layout.fragments[p], flats):
            a = flat.reshape(self.layout.shapes[n])
            a.flags.writeable = False  # decoded values are shared: the sender's and everyone's
            out[n] = a
        return out

    def max_bytes(self, fragment: int) -> int:
        """Largest payload ``decode`` reads for ``fragment``: the header plus its fp32
        size, or plus its size in this codec's format if larger (block padding of
        tiny tensors). Anything longer is refused before it is read."""
        self.layout.check_index(fragment)
        return self._max_bytes[fragment]
