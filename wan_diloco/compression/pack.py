"""Pack stage: one fragment's values <-> the raw (pre-zstd) bytes of its payload.

Tensors go in layout order, back to back, without names or shapes:

* bits 32: little-endian fp32 values.
* bits 16: bf16 bit patterns (round to nearest even), little-endian u16.
* bits 8/4: per zstd chunk of blocks (``chunks``), its blocks' scales as two
  byte planes (high bytes, then low bytes: the exponent plane compresses
  well), then their codes; each tensor is padded to whole blocks
  (``quantize.py`` has the block and nibble layout).

Unpacking reads the raw bytes a chunk at a time (``unpack``'s ``source``), so
a zstd payload is never decompressed whole.

One packer per bit width; ``packer(fmt)`` is the only place that picks one.
Unpacking checks what a forged payload could smuggle in (NaN/Inf values,
impossible scales) and raises CodecError.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco.buffers import POOL
from wan_diloco.compression import blocks, chunks
from wan_diloco.compression.config import BITS, INT4_QMAX, INT8_QMAX, MIN_SCALE, Format
from wan_diloco.compression.errors import CodecError, EncodeError, NonFiniteError
from wan_diloco.compression.host_quantize import HostEncoded, encode_host
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks
from wan_diloco.merge import SERIAL, Workers, chunk_sum_squares, per_tensor, sum_squares

_BF16_EXP = 0x7F80


def _non_finite(name: str, x, why: str) -> NonFiniteError:
    v = np.asarray(x, np.float32)
    n_bad = int(v.size - np.count_nonzero(np.isfinite(v)))
    if n_bad:
        return NonFiniteError(f"tensor {name!r}: {n_bad} NaN/Inf values; refusing to encode")
    return NonFiniteError(f"tensor {name!r}: magnitude {float(np.max(np.abs(v))):.3g} {why}")


def _checked_sums(flats: Sequence[np.ndarray], workers: Workers) -> np.ndarray:
    """Σx² per tensor, refusing NaN/Inf (a non-finite sum: ``merge.chunk_sum_squares``)."""
    sums = sum_squares(flats, workers)
    bad = np.flatnonzero(~np.isfinite(sums))
    if bad.size:
        raise CodecError(f"tensor {int(bad[0])} of the fragment holds NaN/Inf values")
    return sums


class Whole:
    """Raw bytes held whole (a payload stored without zstd), read a chunk at a time as views."""

    def __init__(self, raw, chunk_spans: Sequence[tuple[int, int]]):
        self.raw, self.spans = np.frombuffer(raw, np.uint8), chunk_spans

    def read(self, c: int, out=None) -> np.ndarray:
        off, ln = self.spans[c]
        return self.raw[off:off + ln]


def _into_pool(source, sizes: Sequence[int], itemsize: int, workers: Workers, fill) -> list[np.ndarray]:
    """Flat float32 arrays of ``sizes`` in one pooled buffer, each chunk's values written by ``fill(raw,
    dst)`` (its raw bytes, the float32 values it holds) on ``workers``."""
    buf = POOL.empty(sum(sizes))

    def run(c: int) -> None:
        off, ln = source.spans[c]
        dst = buf[off // itemsize:(off + ln) // itemsize]
        fill(source, c, dst)

    workers.map(run, list(range(len(source.spans))))
    out, pos = [], 0
    for n in sizes:
        out.append(buf[pos:pos + n])
        pos += n
    return out


def _fill_f32(source, c: int, dst: np.ndarray) -> None:
    got = source.read(c, dst.view(np.uint8))  # zstd decompresses straight into the values
    if np.frombuffer(got, np.uint8).ctypes.data != dst.ctypes.data:
        dst.view(np.uint8)[:] = got


def _fill_bf16(source, c: int, dst: np.ndarray) -> None:
    u16 = np.frombuffer(source.read(c, chunks.scratch(2 * dst.size)), "<u2")
    bits = dst.view(np.uint32)
    bits[:] = u16
    bits <<= 16


class _Float32:
    """Raw fp32: encode is a join of the values' bytes, decode is ``np.frombuffer`` views."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        return 4 * sum(sizes)

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> chunks.Packed:
        parts = []
        for name, x in zip(names, arrays):
            v = np.ascontiguousarray(np.asarray(x), "<f4").reshape(-1)
            if not np.isfinite(v).all():
                raise _non_finite(name, v, "")
            parts.append(v)
        return chunks.Packed(fmt, [p.size for p in parts], parts)

    def unpack(self, fmt, source, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        if isinstance(source, Whole):  # views of the payload: nothing to write ``into``
            out, pos = [], 0
            for n in sizes:
                out.append(np.frombuffer(source.raw, "<f4", n, pos))
                pos += 4 * n
        else:
            out = _into_pool(source, sizes, 4, workers, _fill_f32)
        return out, _checked_sums(out, workers)


@jax.jit
def _bf16_bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), jnp.uint16)


class _BFloat16:
    """bf16 values: fp32's exponent range, 8 mantissa bits."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        return 2 * sum(sizes)

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> chunks.Packed:
        parts = []
        for name, x in zip(names, arrays):
            v = np.asarray(_bf16_bits(x)).astype("<u2", copy=False).reshape(-1)
            if ((v & _BF16_EXP) == _BF16_EXP).any():
                raise _non_finite(name, x, "overflows bfloat16")
            parts.append(v)
        return chunks.Packed(fmt, [p.size for p in parts], parts)

    def unpack(self, fmt, source, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        out = _into_pool(source, sizes, 2, workers, _fill_bf16)
        return out, _checked_sums(out, workers)


class _Blockwise:
    """int8 / 4-bit codes with one scale per block."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        nb = sum(n_blocks(n, fmt.block_size) for n in sizes)
        return nb * (2 + code_bytes_per_block(fmt.bits, fmt.block_size))

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> chunks.Packed:
        sizes = [int(np.size(x)) for x in arrays]
        return self.planes(fmt, names, sizes, blocks.quantize_fragment(arrays, sizes, fmt, impl, key, workers),
                           arrays.__getitem__)

    def planes(self, fmt, names, sizes, per_tensor, value_of) -> chunks.Packed:
        """The raw bytes from (codes, scales) per tensor; ``value_of(i)``: tensor i's values, read only
        to name what is wrong with a refused tensor."""
        scale_bits, code_parts = [], []
        for i, (name, (codes, scales)) in enumerate(zip(names, per_tensor)):
            if not np.isfinite(scales).all():
                raise _non_finite(name, value_of(i), _SCALE_OVERFLOW)
            scale_bits.append(_scale_bits(scales, fmt))
            code_parts.append(codes.reshape(-1).view(np.uint8))
        sb = np.concatenate(scale_bits) if scale_bits else np.zeros(0, np.uint16)
        return chunks.Packed(fmt, sizes, code_parts, sb)

    def unpack(self, fmt, source, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        """One zstd chunk at a time on ``workers``: its raw bytes (decompressed into this thread's scratch),
        then per item of blocks the table lookup, times the scales, and the item's Σx² while it is in
        cache (values are finite: ``_scales`` bounds every scale). ``into``: flat float32 arrays (one per
        tensor) to write the values into instead of a pooled buffer."""
        bs, cb = fmt.block_size, code_bytes_per_block(fmt.bits, fmt.block_size)
        starts, first = [], 0
        for n in sizes:
            starts.append(first)
            first += n_blocks(n, bs)
        blocks2d = None if into is not None else POOL.empty(first * bs).reshape(first, bs)  # reused once unreferenced
        out = [blocks2d[s:s + n_blocks(n, bs)].reshape(-1)[:n] if into is None else into[t]
               for t, (s, n) in enumerate(zip(starts, sizes))]
        items = chunks.block_items(sizes, fmt)
        per_chunk: list[list] = [[] for _ in source.spans]
        for it in items:
            per_chunk[it[3]].append(it)

        def run(c: int) -> list[float]:
            off, ln = source.spans[c]
            raw = np.frombuffer(source.read(c, chunks.scratch(ln)), np.uint8)
            m, first = ln // (2 + cb), off // (2 + cb)
            scales = chunk_scales(raw, cb, fmt, first)
            codes = raw[2 * m:].reshape(m, cb)
            sums = []
            for t, a, b, _ in per_chunk[c]:
                n = min(sizes[t], b * bs) - a * bs
                g, lo = starts[t] + a - first, a * bs
                if into is None:
                    dst = blocks2d[starts[t] + a:starts[t] + b]
                elif n == (b - a) * bs:  # whole blocks: straight into the caller's array
                    dst = into[t][lo:lo + n].reshape(b - a, bs)
                else:  # the tensor's padded last block: through a scratch
                    dst = np.empty((b - a, bs), np.float32)
                blocks.dequantize_into(codes[g:g + b - a], scales[g:g + b - a], fmt, dst)
                values = dst.reshape(-1)[:n]  # block padding is not a value
                if into is not None and n != (b - a) * bs:
                    into[t][lo:lo + n] = values
                    values = into[t][lo:lo + n]
                sums.append(chunk_sum_squares(values))
            return sums

        sums = [s for part in workers.map(run, list(range(len(source.spans)))) for s in part]
        return out, per_tensor(len(sizes), [(it[0],) for c in per_chunk for it in c], sums)


_SCALE_OVERFLOW = "overflows a float16 scale; use scale_dtype='bfloat16'"


def _scale_bits(scales: np.ndarray, fmt: Format) -> np.ndarray:
    """The stored 16 bits of float32 scales an encoder made."""
    if fmt.scale_dtype == "bfloat16":  # scales are bf16 values already: keep the top half
        return (scales.view(np.uint32) >> 16).astype(np.uint16)
    return scales.astype(np.float16).view(np.uint16)


def read_scales(bits16: np.ndarray, fmt: Format, first: int = 0) -> np.ndarray:
    """Stored scale bits -> float32 scales, refusing any an encoder cannot write (blocks from ``first``)."""
    if fmt.scale_dtype == "bfloat16":
        scales = (bits16.astype(np.uint32) << 16).view(np.float32)
    else:
        scales = bits16.view(np.float16).astype(np.float32)
    qmax = INT8_QMAX if fmt.bits == 8 else INT4_QMAX
    biggest = np.float32(np.finfo(np.float32).max / qmax)
    bad = ~((scales == 0) | ((scales >= MIN_SCALE) & (scales <= biggest)))
    bad |= (bits16 & 0x8000) != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError(f"scale of block {first + i} is {scales[i]!r}: not 0 or a positive value in "
                         f"[{MIN_SCALE:.3g}, float32 max / {qmax}]")
    return scales


def chunk_scales(raw: np.ndarray, code_bytes: int, fmt: Format, first: int) -> np.ndarray:
    """The float32 scales of an 8/4-bit chunk's raw bytes (its blocks from ``first``), checked: ``read_scales``."""
    m = raw.size // (2 + code_bytes)
    return read_scales((raw[:m].astype(np.uint16) << 8) | raw[m:2 * m], fmt, first)


_PACKERS = {32: _Float32(), 16: _BFloat16(), 8: _Blockwise(), 4: _Blockwise()}


def packer(fmt: Format):
    """The packer for ``fmt.bits``: ``raw_nbytes(fmt, sizes)``, ``pack(fmt, names,
    arrays, impl, key) -> chunks.Packed``, ``unpack(fmt, source, sizes, workers) -> ([flat float32],
    Σx² per tensor)``."""
    try:
        return _PACKERS[fmt.bits]
    except KeyError:
        raise EncodeError(f"bits: {fmt.bits} is not one of {', '.join(map(str, BITS))}") from None


def raw_nbytes(fmt: Format, sizes: Sequence[int]) -> int:
    """Raw (pre-zstd) payload bytes of tensors of ``sizes`` values in ``fmt``."""
    return packer(fmt).raw_nbytes(fmt, sizes)


def pack(fmt: Format, names: Sequence[str], arrays: Sequence[Any], *, impl: str = "jnp",
         key=None, workers: Workers = SERIAL) -> chunks.Packed:
    """The raw bytes of ``arrays`` (layout order); NonFiniteError names a refused tensor. ``workers``:
    the threads that quantize host arrays (any number: the same bytes)."""
    return packer(fmt).pack(fmt, names, arrays, impl, key, workers)


class _BadScales(Exception):
    """A chunk's item of tensor ``t`` has a non-finite scale (NaN/Inf values or a float16 overflow)."""

    def __init__(self, t: int):
        self.t = t


def pack_host(fmt: Format, names: Sequence[str], sizes: Sequence[int], workers: Workers, raw: np.ndarray,
              arrays: Sequence[np.ndarray], minus: Sequence[np.ndarray] | None = None,
              plus: Sequence[np.ndarray] | None = None, decode: bool = False, residual: bool = False,
              produce=None, hold: bool = True) -> HostEncoded:
    """``pack`` of ``arrays − minus + plus`` (numpy, 8 or 4 bits, round to nearest), or of what ``produce``
    makes (``encode_host``'s; ``arrays`` None), in one pass per item of blocks (``host_quantize.encode_host``)
    that writes its scales and codes straight into ``raw`` (uint8, the raw bytes: no per-tensor codes are
    held) and with ``decode`` also decodes them: the decoded values and Σx² (with ``hold``; else only for
    the residual). NonFiniteError names a refused tensor; ``raw`` then holds nothing to keep."""
    bs, cb = fmt.block_size, code_bytes_per_block(fmt.bits, fmt.block_size)
    m, nb, starts = chunks.chunk_blocks(fmt), 0, []
    for n in sizes:
        starts.append(nb)
        nb += n_blocks(n, bs)

    def sink(it, codes, scales) -> None:
        t, a, b, c = it
        if not np.isfinite(scales).all():
            raise _BadScales(t)
        first, mc = c * m, min(m, nb - c * m)
        base, g, k = first * (2 + cb), starts[t] + a - first, b - a
        bits = _scale_bits(scales, fmt)
        np.right_shift(bits, 8, out=raw[base + g:base + g + k], casting="unsafe")
        np.bitwise_and(bits, 0xFF, out=raw[base + mc + g:base + mc + g + k], casting="unsafe")
        codes_at = base + 2 * mc + g * cb
        raw[codes_at:codes_at + k * cb] = codes.reshape(-1).view(np.uint8)

    try:
        return encode_host(arrays, sizes, fmt, workers, minus, plus, decode=decode, residual=residual, sink=sink,
                           produce=produce, hold=hold)
    except _BadScales as e:
        if produce is not None:  # its values are gone: say what the cause may be
            also = "" if fmt.scale_dtype == "bfloat16" else f", or a magnitude that {_SCALE_OVERFLOW}"
            raise NonFiniteError(f"tensor {names[e.t]!r}: NaN/Inf values{also}") from None
        x = np.asarray(arrays[e.t], np.float32)
        x = x - np.asarray(minus[e.t], np.float32) if minus is not None else x
        x = x + np.asarray(plus[e.t], np.float32) if plus is not None else x
        raise _non_finite(names[e.t], x, _SCALE_OVERFLOW) from None


def unpack(fmt: Format, source, sizes: Sequence[int], workers: Workers = SERIAL,
           into: Sequence[np.ndarray] | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Flat float32 arrays from a fragment's raw bytes, read a chunk at a time from ``source`` (``Whole``,
    ``entropy.Chunks`` or ``chunks.Packed``: ``read(c, scratch)`` and ``spans``), and their Σx² (float64,
    per array: the norm checks' input); CodecError for NaN/Inf. ``into``: writable flat float32 arrays of
    ``sizes`` the 8/4-bit formats write the values into; fp32 from a ``Whole`` gives views of its bytes."""
    return packer(fmt).unpack(fmt, source, sizes, workers, into)
