"""FragmentCodec: one fragment's tensors <-> bytes, for every bit width (32 included).

Stages, each its own module: quantize (``blocks`` over ``quantize`` /
``pallas_kernels``) -> pack (``pack``: byte layout of values, scale planes,
codes) -> entropy (``entropy``: zstd per chunk, ``chunks``) -> frame (``frame``:
a fixed header). Both ways the raw bytes go a chunk at a time on the workers.

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

from wan_diloco.compression import chunks, coded, entropy, frame, pack
from wan_diloco.compression.coded import Coded
from wan_diloco.compression.blocks import resolve_impl
from wan_diloco.compression.config import CodecConfig, Format
from wan_diloco.compression.errors import CodecError, EncodeError
from wan_diloco.fragments import Encoded, LazyValues, Layout
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
    def encode(self, values: Mapping[str, Any], key=None) -> bytearray:
        """The payload of one fragment: ``values`` maps exactly its tensor names to
        float arrays (numpy or jax, float32/bfloat16/float16) of the layout's shapes.
        A bytearray: the buffer it was written into chunk by chunk, not copied into bytes.

        ``key`` (a jax PRNG key) is required when ``cfg.stochastic_rounding`` and bits is 8 or 4.
        """
        return self._encode(values, key)[0]

    def roundtrip(self, values: Mapping[str, Any], key=None, *, in_place: bool = False) -> Encoded:
        """``encode`` plus exactly what ``decode`` gives for the payload, bit for bit. ``in_place``: the
        caller needs ``values`` no more, so the decoded values overwrite them where they are writable
        float32 numpy arrays (8/4-bit formats): no second fragment-sized buffer; host arrays are then
        quantized straight into the payload and decoded from it. Without it, host arrays are encoded
        and decoded in one pass (``_roundtrip_host``), into new arrays."""
        p, arrays = self._arrays(values)
        into = None
        if in_place and all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous
                            and x.flags.writeable for x in arrays):
            into = [x.reshape(-1) for x in arrays]
        if self._fused() and all(isinstance(x, np.ndarray) for x in arrays):
            if into is None:
                return self._roundtrip_host(p, arrays)[0]
            # Quantized straight into the payload's raw bytes; decoded from them over the caller's arrays
            # once every value passed (a refused update changes nothing), then zstd in place.
            out = {}

            def fill(raw):
                pack.pack_host(self._fmt, self.layout.fragments[p], self._sizes[p], self.workers, raw, arrays)
                source = pack.Whole(raw, chunks.spans(self._fmt, self._sizes[p]))
                out["values"] = self._unpack(p, self._fmt, source, into)

            data = self._frame(p, fill=fill)
            return Encoded(values=out["values"], nbytes=len(data), payload=data)
        data, p, packed = self._encode(values, key)
        return Encoded(values=self._unpack(p, self._fmt, packed, into), nbytes=len(data), payload=data)

    @property
    def streams(self) -> bool:
        """Whether ``roundtrip_streamed`` encodes (a host 8/4-bit format, rounding to nearest)."""
        return self._fused()

    def roundtrip_streamed(self, fragment: int, produce, base, out, bound_ok) -> Encoded | None:
        """Encode ``fragment`` from values made a work item at a time, never held whole: ``produce(t, lo,
        hi)`` gives values [lo, hi) of tensor t (float32; it may return this thread's ``buffers.thread_scratch``).
        Once every item passed the encoder's checks (NonFiniteError otherwise, ``out`` untouched), out[t] ←
        base[t] + the decoded values (the bits ``decode`` gives, added as ``numpy.add``; flat float32 arrays
        in the layout's order; ``coded.add_decoded``, which first checks every sum where ``bound_ok`` says an
        overflow is possible). Encoded's ``values`` is None: decode the payload for them. None where this
        codec cannot (not a host 8/4-bit format): the caller goes the whole-array way."""
        if not self._fused():
            return None
        names, sizes = self.layout.fragments[fragment], self._sizes[fragment]

        def fill(raw):
            pack.pack_host(self._fmt, names, sizes, self.workers, raw, None, produce=produce)
            coded.add_decoded(self._fmt, pack.Whole(raw, chunks.spans(self._fmt, sizes)), names, sizes,
                              self.workers, base, out, bound_ok)

        data = self._frame(fragment, fill=fill)
        return Encoded(values=None, nbytes=len(data), payload=data)

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
        if self._fused():  # a learner sends the payload: its values are decoded only if someone looks
            enc, host = self._roundtrip_host(p, bases, thetas, pluses, residual, hold=False)
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

    def _roundtrip_host(self, p: int, arrays, minus=None, plus=None, residual: bool = False, hold: bool = True):
        """``hold`` False: the values are decoded from the payload when first looked up (``LazyValues``)."""
        got = {}

        def fill(raw):
            got["host"] = pack.pack_host(self._fmt, self.layout.fragments[p], self._sizes[p], self.workers, raw,
                                         arrays, minus, plus, decode=True, residual=residual, hold=hold)

        data = self._frame(p, fill=fill)
        host = got["host"]
        if not hold:
            lazy = LazyValues(self.layout.fragments[p], lambda: self.decode(p, data))
            return Encoded(values=lazy, nbytes=len(data), payload=data), host
        out = Decoded()
        out.sum_squares = host.sum_squares
        for n, flat in zip(self.layout.fragments[p], host.decoded):
            a = flat.reshape(self.layout.shapes[n])
            a.flags.writeable = False  # as ``_unpack``'s: the values sent are shared
            out[n] = a
        return Encoded(values=out, nbytes=len(data), payload=data), host

    def _encode(self, values: Mapping[str, Any], key) -> tuple[bytearray, int, Any]:
        """(payload, fragment index, its raw pre-zstd bytes: ``chunks.Packed``)."""
        p, arrays = self._arrays(values)
        fmt = self._fmt
        stochastic = self.cfg.stochastic_rounding and fmt.quantized
        if stochastic and key is None:
            raise EncodeError("stochastic_rounding needs a PRNG key: encode(values, key=...)")
        packed = pack.pack(fmt, self.layout.fragments[p], arrays, impl=self._impl,
                           key=key if stochastic else None, workers=self.workers)
        return self._frame(p, packed=packed), p, packed

    def _frame(self, p: int, packed=None, fill=None) -> bytearray:
        """The payload: header, then zstd chunks (if on and smaller) or the raw bytes, all in one buffer and
        a chunk at a time on the workers: the raw bytes are never held apart from it. They come from
        ``packed`` (``chunks.Packed``) or are written by ``fill(raw)`` into their place in the buffer."""
        spans = chunks.spans(self._fmt, self._sizes[p])
        raw_len = sum(ln for _, ln in spans)
        start = frame.HEADER_BYTES
        zstd = self.cfg.zstd and raw_len > 0
        body = start + (entropy.TABLE_ENTRY_BYTES * len(spans) if zstd else 0)
        out = bytearray(body + raw_len)
        raw = np.frombuffer(out, np.uint8, raw_len, body)
        if fill is not None:
            fill(raw)
            def read(c: int, scratch) -> np.ndarray:  # the chunk where ``fill`` put it (a view, dropped after)
                return np.frombuffer(out, np.uint8, spans[c][1], body + spans[c][0])
        elif zstd:
            read = packed.read
        else:
            chunks.copy_raw(packed.read, spans, raw, self.workers)
        del raw  # ``out`` shrinks below: no view of it may live on
        end = body + raw_len
        if zstd:
            end = entropy.compress_chunks(read, spans, self.cfg.zstd_level, self.workers, out, start)
            if end is None:  # not smaller: the raw bytes, without a table
                out[start:start + raw_len] = memoryview(out)[body:body + raw_len]
                zstd, end = False, start + raw_len
        del out[end:]  # in place: shrinking a buffer does not copy it
        out[:start] = frame.pack_header(frame.Header(self._fmt, zstd, p, raw_len, end - start))
        return out

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
    def decode(self, fragment: int, payload: bytes | bytearray | memoryview, *,
               deferred: bool = False) -> Decoded | Coded:
        """Tensors of ``fragment`` (layout names and shapes, float32) from its payload, with their Σx².

        Without zstd, fp32 tensors are read-only views into ``payload``: do not
        mutate a buffer passed in while its tensors are in use. ``deferred`` (8/4 bits; other formats
        decode as without it): a ``Coded``, checked and with its Σx² but the values not yet written,
        for a merge to fold in straight from the codes (a view of ``payload`` where it is stored raw).
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
        spans = chunks.spans(h.fmt, self._sizes[fragment])
        source = entropy.Chunks(body, spans) if h.zstd else pack.Whole(body, spans)
        if deferred and h.fmt.quantized:
            names = self.layout.fragments[fragment]
            return coded.scan(h.fmt, source, names, {n: self.layout.shapes[n] for n in names},
                              self._sizes[fragment], self.workers)
        return self._unpack(fragment, h.fmt, source)

    def _unpack(self, p: int, fmt: Format, source, into=None) -> Decoded:
        """The Decoded of fragment ``p`` from its raw bytes, read a chunk at a time from ``source``."""
        flats, sums = pack.unpack(fmt, source, self._sizes[p], self.workers, into)
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
