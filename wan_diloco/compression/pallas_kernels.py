"""Pallas kernels for blockwise quantize (fused with 4-bit packing) and dequantize.

Each grid step loads a tile of whole quantization blocks, runs the same tile
math as the jax.numpy reference (``quantize.quantize_tile`` / ``_halves``),
and writes codes and scales, so outputs are bit-exact to the reference; the
tests check it. Inputs are zero-padded to whole tiles before the call:
Pallas interpret mode fills partial tiles with NaN, and an all-zero block
quantizes to scale 0, which the caller slices off.

On CPU the kernels run with ``interpret=True`` (tests, benchmarks) with few,
large tiles, because every interpreted grid step has a fixed cost. On GPU they
compile through Pallas' Triton backend with 64-row tiles. The GPU path is
selectable (``impl="pallas"`` or ``"auto"`` on a GPU backend) but has not been
run on a GPU yet: this project's sessions so far had none.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from wan_diloco.compression.quantize import (
    code_bytes_per_block, dequantize_halves, dequantize_tile, from_blocks, quantize_halves,
    quantize_tile, rounding_noise, to_blocks,
)

_INTERPRET_TILE_VALUES = 1 << 22
_GPU_TILE_ROWS = 64


def default_interpret() -> bool:
    """Interpret mode unless a Pallas-capable accelerator is the default backend."""
    return jax.default_backend() not in ("gpu", "tpu")


def _tile_rows(n_rows: int, block_size: int, interpret: bool) -> int:
    if not interpret:
        return _GPU_TILE_ROWS
    cap = max(1, _INTERPRET_TILE_VALUES // block_size)
    steps = -(-n_rows // cap)
    return max(1, -(-n_rows // steps))


def _pad_rows(a, rows: int):
    extra = rows - a.shape[0]
    return a if extra == 0 else jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1))


def _quantize_kernel(*refs, bits, scale_dtype, codebook, stochastic):
    x_ref, u_ref, c_ref, s_ref = refs if stochastic else (refs[0], None, *refs[1:])
    if bits == 8:
        codes, scales = quantize_tile(x_ref[...], None if u_ref is None else u_ref[...], bits=8,
                                      scale_dtype=scale_dtype, codebook=codebook)
    else:
        # Load the two half-blocks as ref slices: the packing (lo | hi << 4)
        # happens in registers, with no value slicing for the backend to lower.
        h = x_ref.shape[1] // 2
        noise = None if u_ref is None else (u_ref[:, :h], u_ref[:, h:])
        codes, scales = quantize_halves(x_ref[:, :h], x_ref[:, h:], noise,
                                        scale_dtype=scale_dtype, codebook=codebook)
    c_ref[...] = codes
    s_ref[...] = scales


def _dequantize_kernel(c_ref, s_ref, o_ref, *, bits, codebook):
    if bits == 8:
        o_ref[...] = dequantize_tile(c_ref[...], s_ref[...], bits=8, codebook=codebook)
    else:
        h = c_ref.shape[1]
        lo, hi = dequantize_halves(c_ref[...], s_ref[...], codebook=codebook)
        o_ref[:, :h] = lo
        o_ref[:, h:] = hi


@partial(jax.jit, static_argnames=("bits", "block_size", "scale_dtype", "codebook", "interpret",
                                   "tile_rows"))
def quantize_pallas(x, key=None, *, bits: int, block_size: int, scale_dtype: str = "bfloat16",
                    codebook: str = "nf4", interpret: bool = True, tile_rows: int | None = None):
    """Pallas twin of :func:`quantize.quantize`; same outputs, bit for bit.

    ``tile_rows`` (quantization blocks per grid step) overrides the default tiling.
    """
    xb = to_blocks(x, block_size)
    n = xb.shape[0]
    cb = code_bytes_per_block(bits, block_size)
    if n == 0:
        return jnp.zeros((0, cb), jnp.int8 if bits == 8 else jnp.uint8), jnp.zeros((0,), jnp.float32)
    rows = tile_rows or _tile_rows(n, block_size, interpret)
    padded = -(-n // rows) * rows
    inputs = [_pad_rows(xb, padded)]
    tile = pl.BlockSpec((rows, block_size), lambda i: (i, 0))
    in_specs = [tile]
    if key is not None:
        inputs.append(_pad_rows(rounding_noise(key, n, block_size), padded))
        in_specs.append(tile)
    codes, scales = pl.pallas_call(
        partial(_quantize_kernel, bits=bits, scale_dtype=scale_dtype, codebook=codebook,
                stochastic=key is not None),
        out_shape=(jax.ShapeDtypeStruct((padded, cb), jnp.int8 if bits == 8 else jnp.uint8),
                   jax.ShapeDtypeStruct((padded,), jnp.float32)),
        grid=(padded // rows,),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((rows, cb), lambda i: (i, 0)),
                   pl.BlockSpec((rows,), lambda i: (i,))),
        interpret=interpret,
    )(*inputs)
    return codes[:n], scales[:n]


@partial(jax.jit, static_argnames=("shape", "bits", "codebook", "interpret", "tile_rows"))
def dequantize_pallas(codes, scales, *, shape: tuple[int, ...], bits: int, codebook: str = "nf4",
                      interpret: bool = True, tile_rows: int | None = None):
    """Pallas twin of :func:`quantize.dequantize`; same outputs, bit for bit."""
    n, cb = codes.shape
    block_size = cb if bits == 8 else 2 * cb
    if n == 0:
        return jnp.zeros(shape, jnp.float32)
    rows = tile_rows or _tile_rows(n, block_size, interpret)
    padded = -(-n // rows) * rows
    out = pl.pallas_call(
        partial(_dequantize_kernel, bits=bits, codebook=codebook),
        out_shape=jax.ShapeDtypeStruct((padded, block_size), jnp.float32),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((rows, cb), lambda i: (i, 0)),
                  pl.BlockSpec((rows,), lambda i: (i,))],
        out_specs=pl.BlockSpec((rows, block_size), lambda i: (i, 0)),
        interpret=interpret,
    )(_pad_rows(codes, padded), _pad_rows(scales, padded))
    return from_blocks(out[:n], shape)
