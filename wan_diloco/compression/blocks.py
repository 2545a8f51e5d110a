"""Quantize stage over a whole fragment, and the host dequantizer every decoder uses.

Encoding quantizes on the arrays' device (jax.numpy or Pallas). Decoding runs
on the host in numpy: ``level[code] * scale`` is the same IEEE multiply
everywhere, and the tests pin jax.numpy and Pallas dequantization to it bit
for bit, so every process that decodes the same bytes holds the same arrays.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco import kernels
from wan_diloco.compression.config import CODEBOOKS, INT4_QMAX, Format
from wan_diloco.compression.host_quantize import quantize_host
from wan_diloco.compression.pallas_kernels import default_interpret, quantize_pallas
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks, quantize, to_blocks
from wan_diloco.merge import SERIAL, Workers

# Tensors up to this size share one quantizer call: a dispatch costs ~20 us,
# more than quantizing a few thousand values.
_SMALL_TENSOR_VALUES = 1 << 16


def resolve_impl(impl: str) -> str:
    """"auto" -> "pallas" on GPU/TPU, "jnp" elsewhere; explicit choices pass through."""
    if impl == "auto":
        return "jnp" if default_interpret() else "pallas"
    return impl


def _quantizer(fmt: Format, impl: str):
    kw = dict(bits=fmt.bits, block_size=fmt.block_size, scale_dtype=fmt.scale_dtype,
              codebook=fmt.codebook or "nf4")
    if resolve_impl(impl) == "pallas":
        return partial(quantize_pallas, interpret=default_interpret(), **kw)
    return partial(quantize, **kw)


@partial(jax.jit, static_argnames=("block_size",))
def _concat_blocks(xs, block_size: int):
    return jnp.concatenate([to_blocks(x, block_size) for x in xs])


def quantize_fragment(arrays: Sequence[Any], sizes: Sequence[int], fmt: Format, impl: str,
                      key=None, workers: Workers = SERIAL) -> list[tuple[np.ndarray, np.ndarray]]:
    """(codes, scales) per tensor, as host arrays: codes ``(n_blocks, code bytes)``
    (int8 for 8 bits, packed uint8 for 4), scales ``(n_blocks,)`` float32.

    A scale is NaN for a block holding NaN/Inf and +Inf where a float16 scale
    overflows; the caller refuses those. ``key`` switches on stochastic rounding.
    numpy arrays on a CPU run are quantized where they lie, in chunks on ``workers``
    (``host_quantize``: the same bits).
    """
    if key is None and resolve_impl(impl) == "jnp" and all(isinstance(x, np.ndarray) for x in arrays):
        return quantize_host(arrays, sizes, fmt, workers)
    qfn = _quantizer(fmt, impl)
    small = [i for i, n in enumerate(sizes) if 0 < n <= _SMALL_TENSOR_VALUES]
    batch_small = len(small) >= 2
    groups = [[i] for i, n in enumerate(sizes) if n and not (batch_small and i in small)]
    if batch_small:
        groups.append(small)
    keys = [None] * len(groups) if key is None else list(jax.random.split(key, len(groups)))
    # Dispatch every group before reading any back, so device work overlaps.
    pending = [(g, qfn(arrays[g[0]] if len(g) == 1 else
                       _concat_blocks(tuple(arrays[i] for i in g), fmt.block_size), k))
               for g, k in zip(groups, keys)]
    empty = np.zeros((0, code_bytes_per_block(fmt.bits, fmt.block_size)), np.uint8)
    out = [(empty, np.zeros(0, np.float32))] * len(sizes)  # empty tensors: no blocks
    for g, res in pending:
        codes, scales = (np.asarray(a) for a in res)
        row = 0
        for i in g:
            rows = n_blocks(sizes[i], fmt.block_size)
            out[i] = codes[row:row + rows], scales[row:row + rows]
            row += rows
    return out


@lru_cache(maxsize=None)
def nibble_levels(codebook: str) -> tuple[np.ndarray, np.ndarray]:
    """Code byte -> the level of its low nibble, and of its high nibble: two 1 KiB float32 tables."""
    lv = CODEBOOKS[codebook] * np.float32(INT4_QMAX)
    b = np.arange(256)
    return np.ascontiguousarray(lv[b & 15], np.float32), np.ascontiguousarray(lv[b >> 4], np.float32)


def dequantize_host(codes: np.ndarray, scales: np.ndarray, fmt: Format) -> np.ndarray:
    """numpy twin of ``quantize.dequantize`` on whole blocks: -> (n_blocks, block_size) float32."""
    out = np.empty((codes.shape[0], fmt.block_size), np.float32)
    dequantize_into(codes, scales, fmt, out)
    return out


def dequantize_into(codes: np.ndarray, scales: np.ndarray, fmt: Format, out: np.ndarray) -> None:
    """``dequantize_host`` into ``out`` (n_blocks, block_size) float32, C-contiguous.

    ``codes`` is (n_blocks, code bytes) uint8 (int8 codes viewed as bytes for 8 bits); 4-bit blocks are
    decoded one byte (two values) at a time by a compiled loop (``kernels.dequantize4``: 2.6x numpy's
    gather, transposing copy and multiply on a 1 MiB chunk, the same bits).
    """
    if fmt.bits == 8:
        np.multiply(codes.view(np.int8), scales[:, None], out=out)
        return
    lo, hi = nibble_levels(fmt.codebook)
    kernels.dequantize4(codes, scales, lo, hi, out)
