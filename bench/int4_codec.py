"""The int4 codec for the end-to-end transport benchmark.

The project codec (``wan_diloco.compression``) when it is importable, else a
clearly labelled numpy stand-in, so the transport can be measured before (and
independently of) the codec.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

BLOCK = 4096  # stand-in: one float32 scale per block of 4096 values


def standin_encode(x: np.ndarray) -> bytes:
    """Symmetric int4 with per-block absmax scales, two values per byte (stand-in)."""
    x = x.reshape(-1, BLOCK)
    scale = np.abs(x).max(axis=1, keepdims=True) / 7.0
    scale[scale == 0] = 1.0
    q = x * (1.0 / scale)
    np.rint(q, out=q)
    np.clip(q, -8, 7, out=q)
    q += 8
    u = q.astype(np.uint8)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    return scale.astype(np.float32).tobytes() + packed.tobytes()


def standin_decode(buf, n: int) -> np.ndarray:
    blocks = n // BLOCK
    scale = np.frombuffer(buf, np.float32, blocks).reshape(-1, 1)
    packed = np.frombuffer(buf, np.uint8, offset=4 * blocks).reshape(blocks, BLOCK // 2)
    out = np.empty((blocks, BLOCK), np.float32)
    out[:, 0::2] = (packed & 15).astype(np.int8) - 8
    out[:, 1::2] = (packed >> 4).astype(np.int8) - 8
    out *= scale
    return out.reshape(-1)


def load_codec():
    """(name, encode(x) -> bytes-like, decode(buf, n) -> array).

    The project codec (``wan_diloco.compression.FragmentCodec`` with a
    one-tensor layout of ``n`` values) at 4 bits with its default block size
    and zstd, when importable and a tiny round trip works; otherwise the numpy
    stand-in above, reported as ``"codec": "standin"``.
    """
    try:
        from wan_diloco.compression import CodecConfig, FragmentCodec
        from wan_diloco.fragments import Layout
        cfg = CodecConfig(bits=4)

        @lru_cache(maxsize=8)
        def codec(n: int) -> FragmentCodec:
            return FragmentCodec(cfg, Layout([("outer_grad",)], {"outer_grad": (n,)}))

        def enc(x):
            return codec(x.size).encode({"outer_grad": x})

        def dec(buf, n):
            return codec(n).decode(0, buf)["outer_grad"]

        probe = np.linspace(-1, 1, 2 * BLOCK, dtype=np.float32)
        if np.abs(np.asarray(dec(enc(probe), probe.size)) - probe).max() > 0.25:
            raise ValueError("int4 round trip too far off")
        return f"wan_diloco.compression (bits=4, {cfg.int4_codebook}, block {cfg.block_size}, zstd={cfg.zstd})", enc, dec
    except (ImportError, AttributeError, TypeError, ValueError, KeyError):
        return "standin", standin_encode, standin_decode
