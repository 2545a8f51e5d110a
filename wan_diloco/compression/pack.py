"""Pack stage: one fragment's values <-> the raw (pre-zstd) bytes of its payload.

Tensors go in layout order, back to back, without names or shapes:

* bits 32: little-endian fp32 values.
* bits 16: bf16 bit patterns (round to nearest even), little-endian u16.
* bits 8/4: every block's scale as two byte planes (high bytes of all scales,
  then low bytes: the exponent plane compresses well), then every tensor's
  codes, each tensor padded to whole blocks (``quantize.py`` has the block
  and nibble layout).

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
from wan_diloco.compression import blocks
from wan_diloco.compression.config import BITS, INT4_QMAX, INT8_QMAX, MIN_SCALE, Format
from wan_diloco.compression.errors import CodecError, EncodeError, NonFiniteError
from wan_diloco.compression.host_quantize import HostEncoded, encode_host
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks
from wan_diloco.merge import CHUNK, SERIAL, Workers, chunk_sum_squares, per_tensor, sum_squares

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


class _Float32:
    """Raw fp32: encode is a join of the values' bytes, decode is ``np.frombuffer`` views."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        return 4 * sum(sizes)

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> list[np.ndarray]:
        parts = []
        for name, x in zip(names, arrays):
            v = np.ascontiguousarray(np.asarray(x), "<f4").reshape(-1)
            if not np.isfinite(v).all():
                raise _non_finite(name, v, "")
            parts.append(v)
        return parts

    def unpack(self, fmt, raw, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        out, pos = [], 0  # views of ``raw``: nothing to write ``into``
        for n in sizes:
            out.append(np.frombuffer(raw, "<f4", n, pos))
            pos += 4 * n
        return out, _checked_sums(out, workers)


@jax.jit
def _bf16_bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), jnp.uint16)


class _BFloat16:
    """bf16 values: fp32's exponent range, 8 mantissa bits."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        return 2 * sum(sizes)

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> list[np.ndarray]:
        parts = []
        for name, x in zip(names, arrays):
            v = np.asarray(_bf16_bits(x)).astype("<u2", copy=False).reshape(-1)
            if ((v & _BF16_EXP) == _BF16_EXP).any():
                raise _non_finite(name, x, "overflows bfloat16")
            parts.append(v)
        return parts

    def unpack(self, fmt, raw, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        flat = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        out, pos = [], 0
        for n in sizes:
            out.append(flat[pos:pos + n])
            pos += n
        return out, _checked_sums(out, workers)


class _Blockwise:
    """int8 / 4-bit codes with one scale per block."""

    def raw_nbytes(self, fmt: Format, sizes: Sequence[int]) -> int:
        nb = sum(n_blocks(n, fmt.block_size) for n in sizes)
        return nb * (2 + code_bytes_per_block(fmt.bits, fmt.block_size))

    def pack(self, fmt, names, arrays, impl, key, workers=SERIAL) -> list[np.ndarray]:
        sizes = [int(np.size(x)) for x in arrays]
        return self.planes(fmt, names, blocks.quantize_fragment(arrays, sizes, fmt, impl, key, workers),
                           arrays.__getitem__)

    def planes(self, fmt, names, per_tensor, value_of) -> list[np.ndarray]:
        """The raw parts from (codes, scales) per tensor; ``value_of(i)``: tensor i's values, read only
        to name what is wrong with a refused tensor."""
        scale_bits, code_parts = [], []
        for i, (name, (codes, scales)) in enumerate(zip(names, per_tensor)):
            if not np.isfinite(scales).all():
                raise _non_finite(name, value_of(i), "overflows a float16 scale; use scale_dtype='bfloat16'")
            if fmt.scale_dtype == "bfloat16":  # scales are bf16 values already: keep the top half
                scale_bits.append((scales.view(np.uint32) >> 16).astype(np.uint16))
            else:
                scale_bits.append(scales.astype(np.float16).view(np.uint16))
            code_parts.append(codes.reshape(-1).view(np.uint8))
        sb = np.concatenate(scale_bits) if scale_bits else np.zeros(0, np.uint16)
        return [(sb >> 8).astype(np.uint8), (sb & 0xFF).astype(np.uint8), *code_parts]

    def unpack(self, fmt, raw, sizes, workers, into=None) -> tuple[list[np.ndarray], np.ndarray]:
        """One pass per chunk of blocks on ``workers``: table lookup, times the scales, and the
        chunk's Σx² while it is in cache (values are finite: ``_scales`` bounds every scale). ``into``:
        flat float32 arrays (one per tensor) to write the values into instead of a pooled buffer."""
        raw = np.frombuffer(raw, np.uint8)
        bs = fmt.block_size
        nb = sum(n_blocks(n, bs) for n in sizes)
        bits16 = (raw[:nb].astype(np.uint16) << 8) | raw[nb:2 * nb]
        scales = _scales(bits16, fmt)
        codes = raw[2 * nb:].reshape(nb, code_bytes_per_block(fmt.bits, bs))
        blocks2d = None if into is not None else POOL.empty(nb * bs).reshape(nb, bs)  # reused once unreferenced
        step = max(1, CHUNK // bs)
        items, out, starts, first = [], [], [], 0  # items: (tensor, first block, end block, its values)
        for t, n in enumerate(sizes):
            k = n_blocks(n, bs)
            items += [(t, first + a, first + min(a + step, k), min(n, (a + step) * bs) - a * bs)
                      for a in range(0, k, step)]
            out.append(blocks2d[first:first + k].reshape(-1)[:n] if into is None else into[t])
            starts.append(first)
            first += k

        def run(it) -> float:
            t, a, b, n = it
            if into is None:
                chunk = blocks2d[a:b]
            elif n == (b - a) * bs:  # whole blocks: straight into the caller's array
                lo = (a - starts[t]) * bs
                chunk = into[t][lo:lo + n].reshape(b - a, bs)
            else:  # the tensor's padded last block: through a scratch
                chunk = np.empty((b - a, bs), np.float32)
            blocks.dequantize_into(codes[a:b], scales[a:b], fmt, chunk)
            values = chunk.reshape(-1)[:n]  # block padding is not a value
            if into is not None and n != (b - a) * bs:
                lo = (a - starts[t]) * bs
                into[t][lo:lo + n] = values
                values = into[t][lo:lo + n]
            return chunk_sum_squares(values)

        return out, per_tensor(len(sizes), items, workers.map(run, items))


def _scales(bits16: np.ndarray, fmt: Format) -> np.ndarray:
    """Stored scale bits -> float32 scales, refusing any an encoder cannot write."""
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
        raise CodecError(f"scale of block {i} is {scales[i]!r}: not 0 or a positive value in "
                         f"[{MIN_SCALE:.3g}, float32 max / {qmax}]")
    return scales


_PACKERS = {32: _Float32(), 16: _BFloat16(), 8: _Blockwise(), 4: _Blockwise()}


def packer(fmt: Format):
    """The packer for ``fmt.bits``: ``raw_nbytes(fmt, sizes)``, ``pack(fmt, names,
    arrays, impl, key) -> [byte-like arrays]``, ``unpack(fmt, raw, sizes, workers) -> ([flat float32],
    Σx² per tensor)``."""
    try:
        return _PACKERS[fmt.bits]
    except KeyError:
        raise EncodeError(f"bits: {fmt.bits} is not one of {', '.join(map(str, BITS))}") from None


def raw_nbytes(fmt: Format, sizes: Sequence[int]) -> int:
    """Raw (pre-zstd) payload bytes of tensors of ``sizes`` values in ``fmt``."""
    return packer(fmt).raw_nbytes(fmt, sizes)


def pack(fmt: Format, names: Sequence[str], arrays: Sequence[Any], *, impl: str = "jnp",
         key=None, workers: Workers = SERIAL) -> list[np.ndarray]:
    """Raw payload parts of ``arrays`` (layout order); NonFiniteError names a refused tensor. ``workers``:
    the threads that quantize host arrays (any number: the same bytes)."""
    return packer(fmt).pack(fmt, names, arrays, impl, key, workers)


def pack_host(fmt: Format, names: Sequence[str], sizes: Sequence[int], workers: Workers, arrays: Sequence[np.ndarray],
              minus: Sequence[np.ndarray] | None = None, plus: Sequence[np.ndarray] | None = None,
              residual: bool = False) -> tuple[list[np.ndarray], HostEncoded]:
    """``pack`` of ``arrays − minus + plus`` (numpy, 8 or 4 bits, round to nearest) in one pass per chunk
    that also decodes them (``host_quantize.encode_host``): (raw parts, the decoded values and Σx²)."""
    enc = encode_host(arrays, sizes, fmt, workers, minus, plus, decode=True, residual=residual)

    def value_of(i: int) -> np.ndarray:
        x = np.asarray(arrays[i], np.float32)
        x = x - np.asarray(minus[i], np.float32) if minus is not None else x
        return x + np.asarray(plus[i], np.float32) if plus is not None else x

    return _PACKERS[fmt.bits].planes(fmt, names, enc.blocks, value_of), enc


def unpack(fmt: Format, raw, sizes: Sequence[int], workers: Workers = SERIAL,
           into: Sequence[np.ndarray] | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Flat float32 arrays from raw payload bytes of exactly ``raw_nbytes(fmt, sizes)``, and their Σx²
    (float64, per array: the norm checks' input, computed in the same pass); CodecError for NaN/Inf.
    ``into``: writable flat float32 arrays of ``sizes`` the 8/4-bit formats write the values into
    (fp32 and bf16 give views of ``raw``, as without)."""
    return packer(fmt).unpack(fmt, raw, sizes, workers, into)
