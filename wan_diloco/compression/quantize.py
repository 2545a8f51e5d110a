"""Blockwise absmax quantizers in jax.numpy (the reference implementation).

A tensor is flattened, zero-padded to whole blocks of ``block_size`` values
and viewed as ``(n_blocks, block_size)``. Each block gets one scale, its
absmax divided by the largest code magnitude and rounded *up* to the scale
dtype, so no value ever lands outside the code range; codes are still clipped
explicitly. Decoding is ``level[code] * scale``: one IEEE multiply, which is
why every implementation (numpy, jax.numpy, Pallas) decodes bit-identically.

int8 codes are round(x / s) in [-127, 127]. 4-bit codes index a 16-entry
codebook (NF4 by default, used scaled to [-4, 4], see ``INT4_QMAX``) and are
packed two per byte: byte j of a
block holds code j (low nibble) and code j + block_size/2 (high nibble), so
packing reads two contiguous halves instead of interleaved lanes.

The block math lives in small functions of plain arrays so the Pallas
kernels (``pallas_kernels.py``) run the very same operations per tile.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco.compression.config import CODEBOOKS, INT4_QMAX, INT8_QMAX, MIN_SCALE

BF16_MAX = float(np.frombuffer(np.uint32(0x7F7F0000).tobytes(), np.float32)[0])


def n_blocks(size: int, block_size: int) -> int:
    """Number of blocks a tensor of ``size`` values occupies."""
    return -(-size // block_size)


def code_bytes_per_block(bits: int, block_size: int) -> int:
    return block_size if bits == 8 else block_size // 2


# ---------------------------------------------------------------- block math
def block_scale(absmax, qmax: float, scale_dtype: str):
    """Per-block scale, rounded up to a value of ``scale_dtype``, as float32.

    0 for an all-zero block; NaN for a block holding NaN/Inf (so the caller
    can reject the input); +Inf when a float16 scale overflows.
    """
    s = jnp.maximum(absmax / qmax, MIN_SCALE)
    if scale_dtype == "bfloat16":
        # Adding 0xFFFF then truncating to the top 16 bits rounds a positive
        # float up to the next bf16 value; clamp the one case that hits Inf.
        up = (jax.lax.bitcast_convert_type(s, jnp.uint32) + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
        s = jnp.minimum(jax.lax.bitcast_convert_type(up, jnp.float32), BF16_MAX)
    else:
        h = s.astype(jnp.float16)
        bumped = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(h, jnp.uint16) + jnp.uint16(1), jnp.float16)
        s = jnp.where(h.astype(jnp.float32) < s, bumped, h).astype(jnp.float32)
    s = jnp.where(absmax == 0, 0.0, s)
    return jnp.where(jnp.isfinite(absmax), s, jnp.nan)


def int8_codes(y, noise=None):
    """y = x / scale in [-127, 127] (up to rounding) -> int32 codes."""
    r = jnp.round(y) if noise is None else jnp.floor(y + noise)
    return jnp.clip(r, -INT8_QMAX, INT8_QMAX).astype(jnp.int32)


def codebook_codes(y, levels: np.ndarray, noise=None):
    """y = x / scale in [levels[0], levels[-1]] -> int32 index of a codebook level.

    Round to nearest counts the midpoints below y; stochastic rounding picks
    the upper neighbour with probability (y - lo) / (hi - lo). Both use only
    compares and selects (no gathers), so they lower on every Pallas backend.
    """
    lv = [float(v) for v in levels[:n_levels(levels)]]
    y = jnp.clip(y, lv[0], lv[-1])
    k = jnp.zeros(y.shape, jnp.int32)
    if noise is None:
        for a, b in zip(lv[:-1], lv[1:]):
            k = k + (y > (a + b) / 2).astype(jnp.int32)
        return k
    lo = jnp.full(y.shape, lv[0], jnp.float32)
    hi = jnp.full(y.shape, lv[-1], jnp.float32)
    for v in lv[1:]:
        above = y >= v
        k = k + above.astype(jnp.int32)
        lo = jnp.where(above, v, lo)
    for v in reversed(lv[:-1]):
        hi = jnp.where(v > y, v, hi)
    p = jnp.where(hi > lo, (y - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
    return k + (noise < p).astype(jnp.int32)


def n_levels(levels: np.ndarray) -> int:
    # Uniform int4 has 15 real levels; its 16th table entry (0) is padding.
    return 15 if levels[-1] == 0 else 16


def codebook_lookup(k, levels: np.ndarray):
    """int32 codes -> float32 levels by a select chain (exact, gather-free)."""
    out = jnp.zeros(k.shape, jnp.float32)
    for i, v in enumerate(levels):
        if v != 0.0:
            out = jnp.where(k == i, float(v), out)
    return out


def pack_nibbles(k_lo, k_hi):
    """Two int32 code arrays in [0, 15] -> uint8 bytes (lo | hi << 4)."""
    return ((k_lo & 15) | ((k_hi & 15) << 4)).astype(jnp.uint8)


def unpack_nibbles(b):
    """uint8 bytes -> (low codes, high codes) as int32; widen before shifting."""
    w = b.astype(jnp.int32)
    return w & 15, (w >> 4) & 15


def quantize_tile(x, noise, *, bits: int, scale_dtype: str, codebook: str):
    """(rows, block) float32 tile -> (codes, scales). Shared by jnp and Pallas."""
    # One reduction over whole rows: XLA on CPU ran it 5x faster than two over halves.
    absmax = jnp.max(jnp.abs(x), axis=1)
    if bits == 4:
        h = x.shape[1] // 2
        return quantize_halves(x[:, :h], x[:, h:], None if noise is None else (noise[:, :h], noise[:, h:]),
                               absmax=absmax, scale_dtype=scale_dtype, codebook=codebook)
    s = block_scale(absmax, float(INT8_QMAX), scale_dtype)
    # Multiply by a per-block reciprocal: XLA rewrites a divide into this
    # anyway, so spelling it out keeps every backend alike.
    inv = (1.0 / jnp.where(s > 0, s, 1.0))[:, None]
    return int8_codes(x * inv, noise).astype(jnp.int8), s


def quantize_halves(x_lo, x_hi, noise, *, scale_dtype: str, codebook: str, absmax=None):
    """4-bit quantize of a tile given as its two half-blocks (the packing layout).

    Taking halves lets a kernel load them as two ref slices instead of
    slicing a loaded value. ``noise`` is None or a (lo, hi) pair; ``absmax``
    per row is computed from the halves unless given (same value either way).
    """
    if absmax is None:
        absmax = jnp.maximum(jnp.max(jnp.abs(x_lo), axis=1), jnp.max(jnp.abs(x_hi), axis=1))
    s = block_scale(absmax, float(INT4_QMAX), scale_dtype)
    inv = (1.0 / jnp.where(s > 0, s, 1.0))[:, None]
    levels = CODEBOOKS[codebook] * INT4_QMAX
    lo = codebook_codes(x_lo * inv, levels, None if noise is None else noise[0])
    hi = codebook_codes(x_hi * inv, levels, None if noise is None else noise[1])
    return pack_nibbles(lo, hi), s


def dequantize_halves(codes, scales, *, codebook: str):
    """Packed 4-bit codes -> (first half-blocks, second half-blocks) as float32."""
    s = scales[:, None]
    levels = CODEBOOKS[codebook] * INT4_QMAX
    k_lo, k_hi = unpack_nibbles(codes)
    return codebook_lookup(k_lo, levels) * s, codebook_lookup(k_hi, levels) * s


def dequantize_tile(codes, scales, *, bits: int, codebook: str):
    """Inverse of :func:`quantize_tile`: (codes, scales) -> (rows, block) float32."""
    if bits == 8:
        return codes.astype(jnp.float32) * scales[:, None]
    return jnp.concatenate(dequantize_halves(codes, scales, codebook=codebook), axis=1)


# ------------------------------------------------------------ whole tensors
def to_blocks(x, block_size: int):
    """Flatten and zero-pad to whole blocks: -> (n_blocks, block_size)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    pad = (-flat.size) % block_size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block_size)


def from_blocks(blocks, shape):
    """Drop the padding and restore ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    return jnp.ravel(blocks)[:size].reshape(shape)


def rounding_noise(key, n_rows: int, block_size: int):
    """Uniform [0, 1) noise for stochastic rounding; same for every impl."""
    return jax.random.uniform(key, (n_rows, block_size), jnp.float32)


@partial(jax.jit, static_argnames=("bits", "block_size", "scale_dtype", "codebook"))
def quantize(x, key=None, *, bits: int, block_size: int, scale_dtype: str = "bfloat16",
             codebook: str = "nf4"):
    """Quantize any-shaped float array blockwise (jax.numpy reference).

    Returns ``(codes, scales)``: codes ``(n_blocks, block_size)`` int8 for
    ``bits=8`` or ``(n_blocks, block_size // 2)`` uint8 for ``bits=4``;
    scales ``(n_blocks,)`` float32 holding values of ``scale_dtype``.
    ``key`` switches on stochastic rounding.
    """
    xb = to_blocks(x, block_size)
    noise = None if key is None else rounding_noise(key, xb.shape[0], block_size)
    return quantize_tile(xb, noise, bits=bits, scale_dtype=scale_dtype, codebook=codebook)


@partial(jax.jit, static_argnames=("shape", "bits", "codebook"))
def dequantize(codes, scales, *, shape: tuple[int, ...], bits: int, codebook: str = "nf4"):
    """Inverse of :func:`quantize`: float32 array of ``shape``."""
    return from_blocks(dequantize_tile(codes, scales, bits=bits, codebook=codebook), shape)
