"""numpy twin of ``quantize.quantize`` (round to nearest) for host arrays, in chunks of blocks on a pool.

The syncer encodes its update from numpy arrays on the CPU: handing them to jax copies each tensor,
pads it and runs one XLA call per tensor on XLA's own threads. Here each chunk of blocks is quantized
where it lies, on the caller's ``Workers``, with the same float32 operations in the same order as
``quantize.quantize_tile`` (IEEE division, multiply, compares), so the codes and scales are the same
bits (tests/compression/test_host_quantize.py pins them to jax.numpy's). Stochastic rounding stays on jax.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from wan_diloco.compression.config import CODEBOOKS, INT4_QMAX, INT8_QMAX, MIN_SCALE, Format
from wan_diloco.compression.quantize import BF16_MAX, n_levels, code_bytes_per_block, n_blocks
from wan_diloco.merge import CHUNK, Workers


@lru_cache(maxsize=None)
def _midpoints(codebook: str) -> tuple[np.ndarray, np.float32, np.float32]:
    """(float32 midpoints between neighbouring levels, lowest level, highest level), as
    ``quantize.codebook_codes`` compares them: python floats, cast to float32."""
    lv = [float(v) for v in (CODEBOOKS[codebook] * INT4_QMAX)[:n_levels(CODEBOOKS[codebook] * INT4_QMAX)]]
    mids = np.array([(a + b) / 2 for a, b in zip(lv[:-1], lv[1:])], np.float32)
    return mids, np.float32(lv[0]), np.float32(lv[-1])


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


def _tile(x: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """``quantize.quantize_tile`` without noise: (rows, block) float32 -> (codes, scales)."""
    absmax = np.max(np.abs(x), axis=1)
    if fmt.bits == 8:
        s = _scales(absmax, INT8_QMAX, fmt.scale_dtype)
        inv = (np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)))[:, None]
        with np.errstate(invalid="ignore"):
            y = np.rint(x * inv)
        return np.clip(y, -INT8_QMAX, INT8_QMAX).astype(np.int8), s
    s = _scales(absmax, INT4_QMAX, fmt.scale_dtype)
    inv = (np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)))[:, None]
    mids = _midpoints(fmt.codebook or "nf4")[0]
    h = x.shape[1] // 2
    y = np.multiply(x, inv)
    # The number of midpoints below y, one compare each (searchsorted and a grid of cells with two table
    # lookups measured slower: numpy gathers cost ten compares). No clip to the levels' range first:
    # past either end the count is the same.
    k = np.empty(y.shape, np.uint8)
    np.greater(y, mids[0], out=k.view(np.bool_))
    above = np.empty(y.shape, np.bool_)
    for m in mids[1:]:
        np.greater(y, m, out=above)
        k += above.view(np.uint8)
    if h % 8:
        return k[:, :h] | (k[:, h:] << 4), s
    # Codes are < 16: shifting 8 at a time in a u64 moves no bit into the next byte.
    return (k[:, :h].view(np.uint64) | (k[:, h:].view(np.uint64) << np.uint64(4))).view(np.uint8), s


def quantize_host(arrays: Sequence[np.ndarray], sizes: Sequence[int], fmt: Format,
                  workers: Workers) -> list[tuple[np.ndarray, np.ndarray]]:
    """``blocks.quantize_fragment``'s result for float32 host arrays: (codes, scales) per tensor."""
    bs, cb = fmt.block_size, code_bytes_per_block(fmt.bits, fmt.block_size)
    step = max(1, CHUNK // bs)
    out, items = [], []
    for t, (x, n) in enumerate(zip(arrays, sizes)):
        k = n_blocks(n, bs)
        out.append((np.empty((k, cb), np.int8 if fmt.bits == 8 else np.uint8), np.empty(k, np.float32)))
        items += [(t, a, min(a + step, k)) for a in range(0, k, step)]
    flats = [np.ravel(np.asarray(x, np.float32)) for x in arrays]

    def run(it) -> None:
        t, a, b = it
        x, n = flats[t], sizes[t]
        if b * bs <= n:
            tile = x[a * bs:b * bs].reshape(b - a, bs)
        else:  # the tensor's last block: zero-padded, as ``quantize.to_blocks`` pads
            tile = np.zeros((b - a) * bs, np.float32)
            tile[:n - a * bs] = x[a * bs:n]
            tile = tile.reshape(b - a, bs)
        codes, scales = _tile(tile, fmt)
        out[t][0][a:b], out[t][1][a:b] = codes, scales

    workers.map(run, items)
    return out
