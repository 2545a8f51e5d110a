"""numpy twin of ``quantize.quantize`` (round to nearest) for host arrays, in chunks of blocks on a pool.

The syncer encodes its update from numpy arrays on the CPU: handing them to jax copies each tensor,
pads it and runs one XLA call per tensor on XLA's own threads. Here each chunk of blocks is quantized
where it lies, on the caller's ``Workers``, with the same float32 operations in the same order as
``quantize.quantize_tile`` (IEEE division, multiply, compares), so the codes and scales are the same
bits (tests/compression/test_host_quantize.py pins them to jax.numpy's). Stochastic rounding stays on jax.

``encode_host`` does more in the same pass over each chunk, while it is in cache: the values may be a
difference and a sum of arrays (a learner's Δ = Θ − θ plus its error-feedback residual, never held
whole), and the decoded values (level × scale from the level index, the multiply ``blocks.dequantize_into``
does, so the same bits as decoding the payload), their Σx² and what the codes dropped may come with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from wan_diloco import kernels
from wan_diloco.compression.config import CODEBOOKS, INT4_QMAX, INT8_QMAX, MIN_SCALE, Format
from wan_diloco.compression.quantize import BF16_MAX, n_levels, code_bytes_per_block, n_blocks
from wan_diloco.buffers import thread_scratch
from wan_diloco.compression.chunks import block_items
from wan_diloco.merge import Workers, chunk_sum_squares, per_tensor


@lru_cache(maxsize=None)
def _midpoints(codebook: str) -> tuple[np.float32, ...]:
    """The float32 midpoints between neighbouring levels, ascending, as ``quantize.codebook_codes``
    compares them: python floats, cast to float32 (a tuple: ``kernels.quantize4`` unrolls over it)."""
    lv = [float(v) for v in (CODEBOOKS[codebook] * INT4_QMAX)[:n_levels(CODEBOOKS[codebook] * INT4_QMAX)]]
    return tuple(np.float32((a + b) / 2) for a, b in zip(lv[:-1], lv[1:]))


@lru_cache(maxsize=None)
def _levels(codebook: str) -> np.ndarray:
    """The float32 level of each 4-bit code, as the decoder's table (``blocks``) holds them."""
    return CODEBOOKS[codebook] * np.float32(INT4_QMAX)


def _scales(absmax: np.ndarray, qmax: int, scale_dtype: str) -> np.ndarray:
    """``quantize.block_scale`` in numpy."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.maximum(absmax / np.float32(qmax), np.float32(MIN_SCALE))
        if scale_dtype == "bfloat16":
            up = (s.view(np.uint32) + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
            s = np.minimum(up.view(np.float32), np.float32(BF16_MAX))
        else:
            h = s.astype(np.float16)
            bumped = (h.view(np.uint16) + np.uint16(1)).view(np.float16)
            s = np.where(h.astype(np.float32) < s, bumped, h).astype(np.float32)
    s = np.where(absmax == 0, np.float32(0), s)
    return np.where(np.isfinite(absmax), s, np.float32(np.nan)).astype(np.float32, copy=False)


def _tile(x: np.ndarray, fmt: Format, dec: np.ndarray | None = None,
          res: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``quantize.quantize_tile`` without noise: (rows, block) float32 -> (codes, scales); with ``dec``
    ((rows, block) float32) also the decoded values there, with ``res`` also x − decoded."""
    if fmt.bits == 8:
        s = _scales(np.max(np.abs(x), axis=1), INT8_QMAX, fmt.scale_dtype)
        inv = (np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)))[:, None]
        with np.errstate(invalid="ignore"):  # a non-finite block is refused once its scale is seen
            y = np.rint(x * inv)
            q = np.clip(y, -INT8_QMAX, INT8_QMAX).astype(np.int8)
        if dec is not None:
            np.multiply(q, s[:, None], out=dec)
            if res is not None:
                np.subtract(x, dec, out=res)
        return q, s
    # One compiled pass per block (``kernels.quantize4``): numpy took seventeen passes over the chunk.
    absmax = np.empty(x.shape[0], np.uint32)
    kernels.block_absmax_bits(x.view(np.uint32), absmax)
    absmax = absmax.view(np.float32)
    s = _scales(absmax, INT4_QMAX, fmt.scale_dtype)
    inv = np.float32(1.0) / np.where(s > 0, s, np.float32(1.0))
    codes = np.empty((x.shape[0], x.shape[1] // 2), np.uint8)
    none = np.empty((0, x.shape[1]), np.float32)  # no decoded values / residual wanted
    kernels.quantize4(x, inv, s, _midpoints(fmt.codebook or "nf4"), _levels(fmt.codebook or "nf4"), codes,
                      none if dec is None else dec, none if res is None else res)
    return codes, s


_NO_VALUES = np.empty(0, np.float32)


@dataclass
class HostEncoded:
    """``encode_host``'s result, per tensor in the order given."""

    blocks: list[tuple[np.ndarray, np.ndarray]]  # (codes, scales): ``blocks.quantize_fragment``'s result
    decoded: list[np.ndarray] | None = None  # flat float32: what decoding the codes gives
    sum_squares: np.ndarray | None = None  # Σ decoded², float64, summed as ``pack.unpack`` sums it
    residual: list[np.ndarray] | None = None  # flat float32: values − decoded


def encode_host(arrays: Sequence[np.ndarray], sizes: Sequence[int], fmt: Format, workers: Workers,
                minus: Sequence[np.ndarray] | None = None, plus: Sequence[np.ndarray] | None = None,
                decode: bool = False, residual: bool = False, sink=None, produce=None, hold: bool = True
                ) -> HostEncoded:
    """Quantize ``arrays − minus + plus`` (float32, computed a chunk at a time in that order: the bits of
    the whole-array expression), or the values ``produce(t, lo, hi)`` makes for values [lo, hi) of tensor
    t (float32; it may return this thread's ``buffers.thread_scratch``), and, with ``decode``, decode
    them; with ``residual`` also keep what the codes dropped. The items of blocks are ``pack.unpack``'s
    (``chunks.block_items``), so Σx² is its sum to the bit. ``sink(item, codes, scales)``: takes each item's
    codes and scales where it wants them (``pack.pack_host``: straight into the payload's raw bytes) instead
    of per-tensor arrays. ``hold`` False: each item is decoded into a scratch for its residual only (no
    decoded values or Σx² come back)."""
    bs, cb = fmt.block_size, code_bytes_per_block(fmt.bits, fmt.block_size)
    residual = residual and decode
    out, dec, res = [], [], []
    for t, n in enumerate(sizes):
        k = n_blocks(n, bs)
        if sink is None:
            out.append((np.empty((k, cb), np.int8 if fmt.bits == 8 else np.uint8), np.empty(k, np.float32)))
        if decode and hold:
            dec.append(np.empty(k * bs, np.float32))
        if residual:
            res.append(np.empty(n, np.float32))
    items = block_items(sizes, fmt)
    # ``arrays`` is None with ``produce``.
    flat = [[np.ravel(x) for x in xs] if xs is not None else None for xs in (arrays, minus, plus)]

    def values(t: int, lo: int, hi: int) -> np.ndarray:
        if produce is not None:
            return produce(t, lo, hi)
        x = np.asarray(flat[0][t][lo:hi], np.float32)
        if minus is not None:  # x − minus (+ plus) in one pass, into this thread's scratch
            m = np.ascontiguousarray(flat[1][t][lo:hi], np.float32)
            c = _NO_VALUES if plus is None else np.ascontiguousarray(flat[2][t][lo:hi], np.float32)
            out = thread_scratch(hi - lo)
            kernels.difference_plus(np.ascontiguousarray(x), m, c, out)
            return out
        if plus is not None:
            x = x + np.asarray(flat[2][t][lo:hi], np.float32)
        return x

    def run(it) -> float | None:
        t, a, b, _ = it
        lo, hi = a * bs, min(b * bs, sizes[t])
        x = values(t, lo, hi)
        if hi - lo == (b - a) * bs:
            tile = x.reshape(b - a, bs)
        else:  # the tensor's last block: zero-padded, as ``quantize.to_blocks`` pads
            tile = np.zeros((b - a) * bs, np.float32)
            tile[:hi - lo] = x
            tile = tile.reshape(b - a, bs)
        d = None if not decode else (dec[t][lo:b * bs] if hold else thread_scratch((b - a) * bs, 1)).reshape(b - a, bs)
        whole = residual and hi - lo == (b - a) * bs
        codes, scales = _tile(tile, fmt, d, res[t][lo:hi].reshape(b - a, bs) if whole else None)
        if sink is None:
            out[t][0][a:b], out[t][1][a:b] = codes, scales
        else:
            sink(it, codes, scales)
        if not decode:
            return None
        d = d.reshape(-1)[:hi - lo]
        if residual and not whole:  # the padded last block: the residual holds the values only
            np.subtract(x, d, out=res[t][lo:hi])
        return chunk_sum_squares(d) if hold else None

    sums = workers.map(run, items)
    if not decode or not hold:
        return HostEncoded(out, residual=res if residual else None)
    return HostEncoded(out, [d[:n] for d, n in zip(dec, sizes)], per_tensor(len(sizes), items, sums),
                       res if residual else None)


def quantize_host(arrays: Sequence[np.ndarray], sizes: Sequence[int], fmt: Format,
                  workers: Workers) -> list[tuple[np.ndarray, np.ndarray]]:
    """``blocks.quantize_fragment``'s result for float32 host arrays: (codes, scales) per tensor."""
    return encode_host(arrays, sizes, fmt, workers).blocks
