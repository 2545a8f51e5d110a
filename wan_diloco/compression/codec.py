"""encode / decode of one fragment: named float32 tensors <-> bytes.

Encoding quantizes on the array's device (jax.numpy or Pallas), then builds
the payload on the host. Decoding runs on the host in numpy by default: it is
the same IEEE multiply everywhere, and the tests pin jax.numpy and Pallas
dequantization to it bit for bit, so every process that decodes the same
bytes holds the same arrays.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import zstandard

from wan_diloco.compression import wire
from wan_diloco.compression.config import CODEBOOKS, INT4_QMAX, INT8_QMAX, MIN_SCALE, CodecConfig
from wan_diloco.compression.pallas_kernels import (
    default_interpret, dequantize_pallas, quantize_pallas,
)
from wan_diloco.compression.quantize import (
    code_bytes_per_block, dequantize, n_blocks, quantize, to_blocks,
)
from wan_diloco.compression.wire import CodecError, TensorSpec

_BF16_EXP = 0x7F80
_ZSTD_WRITE_BYTES = 1 << 22
_PLAUSIBLE_ZSTD_RATIO = 64
_SMALL_TENSOR_VALUES = 1 << 16


@lru_cache(maxsize=None)
def _pair_luts(codebook: str) -> tuple[np.ndarray, np.ndarray]:
    """Tables from two code bytes (a little-endian u16) to the two low-nibble
    levels and to the two high-nibble levels, each pair packed in a u64: one
    numpy gather then fills two float32 outputs (1 MiB per codebook)."""
    lv = CODEBOOKS[codebook] * np.float32(INT4_QMAX)
    b = np.arange(65536)
    lo = np.stack([lv[b & 15], lv[(b >> 8) & 15]], axis=1).astype("<f4")
    hi = np.stack([lv[(b >> 4) & 15], lv[b >> 12]], axis=1).astype("<f4")
    return lo.view("<u8").ravel(), hi.view("<u8").ravel()


class EncodeError(ValueError):
    """A fragment cannot be encoded (bad name, dtype, shape or config)."""


class NonFiniteError(EncodeError):
    """A tensor holds NaN or Inf (or overflows the chosen scale/value format)."""


def resolve_impl(impl: str) -> str:
    """"auto" -> "pallas" on GPU/TPU, "jnp" elsewhere; explicit choices pass through."""
    if impl == "auto":
        return "jnp" if default_interpret() else "pallas"
    return impl


# ------------------------------------------------------------------ encode
def encode(fragment: Mapping[str, Any], cfg: CodecConfig = CodecConfig(), *, key=None) -> bytes:
    """Encode a fragment (name -> float array, numpy or jax) into one message.

    Raises :class:`NonFiniteError` naming the tensor if any value is NaN/Inf,
    before producing any bytes; :class:`EncodeError` for other bad input.
    ``key`` (a jax PRNG key) is required when ``cfg.stochastic_rounding``.
    """
    try:
        cfg.validate()
    except ValueError as e:
        raise EncodeError(f"codec config: {e}") from None
    if cfg.stochastic_rounding and cfg.quantized and key is None:
        raise EncodeError("stochastic_rounding needs a PRNG key: encode(..., key=...)")
    specs, arrays = _check_fragment(fragment)
    if cfg.quantized:
        parts = _encode_quantized(specs, arrays, cfg, key if cfg.stochastic_rounding else None)
    else:
        parts = _encode_plain(specs, arrays, cfg.bits)
    raw_len = sum(p.nbytes for p in parts)
    if cfg.zstd:
        # One-shot compress of the joined parts: twice as fast as streaming
        # them through compressobj, and it records the content size in the
        # frame header, which decode checks.
        joined = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts]) if parts else b""
        parts = [zstandard.ZstdCompressor(level=cfg.zstd_level).compress(joined)]
    payload_len = sum(memoryview(p).nbytes for p in parts)
    header = wire.pack_header(
        cfg.bits, cfg.zstd, cfg.scale_dtype if cfg.quantized else None,
        cfg.int4_codebook if cfg.bits == 4 else None, cfg.block_size if cfg.quantized else 0,
        specs, raw_len, payload_len)
    return wire.seal(header, parts)


def _check_fragment(fragment) -> tuple[tuple[TensorSpec, ...], list]:
    if not isinstance(fragment, Mapping):
        raise EncodeError(f"fragment must map names to arrays, got {type(fragment).__name__}")
    if len(fragment) > wire.MAX_TENSORS:
        raise EncodeError(f"fragment has {len(fragment)} tensors, the limit is {wire.MAX_TENSORS}")
    specs, arrays = [], []
    for name, x in fragment.items():
        try:
            ok = isinstance(name, str) and 0 < len(name.encode("utf-8")) <= wire.MAX_NAME_BYTES
        except UnicodeEncodeError:
            ok = False
        if not ok:
            raise EncodeError(f"tensor name {name!r}: must be a non-empty str of at most "
                              f"{wire.MAX_NAME_BYTES} UTF-8 bytes")
        dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
            raise EncodeError(f"tensor {name!r}: dtype {dtype} is not float32 (or float16/bfloat16)")
        shape = tuple(int(d) for d in np.shape(x))
        if len(shape) > wire.MAX_NDIM:
            raise EncodeError(f"tensor {name!r}: {len(shape)} dims, the limit is {wire.MAX_NDIM}")
        specs.append(TensorSpec(name, shape))
        arrays.append(x)
    return tuple(specs), arrays


def _non_finite(name: str, x, why: str = "") -> NonFiniteError:
    v = np.asarray(x, np.float32)
    n_bad = int(v.size - np.count_nonzero(np.isfinite(v)))
    if n_bad:
        return NonFiniteError(f"tensor {name!r}: {n_bad} NaN/Inf values; refusing to encode")
    return NonFiniteError(f"tensor {name!r}: magnitude {float(np.max(np.abs(v))):.3g} {why}")


@jax.jit
def _bf16_bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), jnp.uint16)


def _encode_plain(specs, arrays, bits: int) -> bytes:
    parts = []
    for spec, x in zip(specs, arrays):
        if bits == 32:
            v = np.asarray(x, np.float32).astype("<f4", copy=False).ravel()
            if not np.isfinite(v).all():
                raise _non_finite(spec.name, x)
        else:
            v = np.asarray(_bf16_bits(x)).astype("<u2", copy=False).ravel()
            if ((v & _BF16_EXP) == _BF16_EXP).any():
                raise _non_finite(spec.name, x, "overflows bfloat16")
        parts.append(v)
    return parts


def _quantizer(cfg: CodecConfig):
    impl = resolve_impl(cfg.impl)
    kw = dict(bits=cfg.bits, block_size=cfg.block_size, scale_dtype=cfg.scale_dtype,
              codebook=cfg.int4_codebook)
    if impl == "pallas":
        return partial(quantize_pallas, interpret=default_interpret(), **kw)
    return partial(quantize, **kw)


@partial(jax.jit, static_argnames=("block_size",))
def _concat_blocks(xs, block_size: int):
    return jnp.concatenate([to_blocks(x, block_size) for x in xs])


def _encode_quantized(specs, arrays, cfg: CodecConfig, key) -> list[np.ndarray]:
    qfn = _quantizer(cfg)
    # Small tensors (biases, norms) share one quantizer call: a dispatch costs
    # ~20 us, more than quantizing a few thousand values.
    small = [i for i, t in enumerate(specs) if 0 < t.size <= _SMALL_TENSOR_VALUES]
    groups = [[i] for i, t in enumerate(specs) if t.size and (len(small) < 2 or i not in small)]
    if len(small) >= 2:
        groups.append(small)
    keys = [None] * len(groups) if key is None else list(jax.random.split(key, len(groups)))
    # Dispatch every group before reading any back, so device work overlaps.
    pending = [(g, qfn(arrays[g[0]] if len(g) == 1 else
                       _concat_blocks(tuple(arrays[i] for i in g), cfg.block_size), k))
               for g, k in zip(groups, keys)]
    per_tensor = {}
    for g, res in pending:
        codes, scales = (np.asarray(a) for a in res)
        row = 0
        for i in g:
            rows = n_blocks(specs[i].size, cfg.block_size)
            per_tensor[i] = codes[row:row + rows], scales[row:row + rows]
            row += rows
    scale_bits, code_parts = [], []
    for i in sorted(per_tensor):
        codes, scales = per_tensor[i]
        if not np.isfinite(scales).all():
            raise _non_finite(specs[i].name, arrays[i],
                              "overflows a float16 scale; use scale_dtype='bfloat16'")
        if cfg.scale_dtype == "bfloat16":
            scale_bits.append((scales.view(np.uint32) >> 16).astype(np.uint16))
        else:
            scale_bits.append(scales.astype(np.float16).view(np.uint16))
        code_parts.append(codes.reshape(-1).view(np.uint8))
    sb = np.concatenate(scale_bits) if scale_bits else np.zeros(0, np.uint16)
    planes = np.concatenate([(sb >> 8).astype(np.uint8), (sb & 0xFF).astype(np.uint8)])
    return [planes] + code_parts


# ------------------------------------------------------------------ decode
def decode(data, *, max_bytes: int | None = None, impl: str = "numpy") -> dict[str, np.ndarray]:
    """Decode one message into {name: float32 array}.

    Every field and length is validated before the payload is touched; any
    malformed input raises :class:`CodecError` naming what was wrong.
    ``max_bytes`` caps both the message and the decoded size (default
    ``wire.DEFAULT_MAX_BYTES``, 4 GiB); pass the fragment's expected size.
    ``impl`` picks the dequantizer ("numpy", "jnp", "pallas"); all give the
    same bits.
    """
    if impl not in ("numpy", "jnp", "pallas"):
        raise ValueError(f"impl must be 'numpy', 'jnp' or 'pallas', got {impl!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise CodecError("message buffer is not contiguous")
    mv = mv.cast("B")
    h = wire.parse_header(mv, wire.DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
    payload = mv[h.header_len:h.header_len + h.payload_len]
    raw = np.frombuffer(_decompress(payload, h.raw_len) if h.zstd else payload, np.uint8)
    if h.bits == 32:
        flat = raw.view("<f4").astype(np.float32)
    elif h.bits == 16:
        flat = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        flat = _dequantize_payload(raw, h, impl)
    if h.bits in (32, 16) and not np.isfinite(flat).all():
        raise CodecError("payload holds NaN/Inf values")
    return _split(flat, h)


def _decompress(payload: memoryview, raw_len: int) -> bytes:
    # The frame's own content size must match the header, and zstd stops at
    # it while decoding. Output is allocated up front only when the ratio is
    # plausible for quantized codes; past that, decompressobj grows it as
    # data really decodes, so a forged length cannot buy a huge allocation.
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd frame header is invalid: {e}") from None
    if size != raw_len:
        raise CodecError(f"zstd frame declares {size} bytes, header says {raw_len}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if raw_len <= _PLAUSIBLE_ZSTD_RATIO * len(payload):
            # One shot is faster; it allocates raw_len, at most 64x what arrived.
            out = dctx.decompress(payload, max_output_size=raw_len, allow_extra_data=False)
        else:
            # Highly compressible (e.g. all zeros) or forged: grow as data decodes.
            dobj = dctx.decompressobj(write_size=_ZSTD_WRITE_BYTES)
            out = dobj.decompress(payload)
            if not dobj.eof:
                raise CodecError("zstd payload is truncated")
            if dobj.unused_data:
                raise CodecError(f"{len(dobj.unused_data)} bytes after the zstd frame")
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd payload is corrupt: {e}") from None
    if len(out) != raw_len:
        raise CodecError(f"zstd payload decoded to {len(out)} bytes, header says {raw_len}")
    return out


def _dequantize_payload(raw: np.ndarray, h: wire.Header, impl: str) -> np.ndarray:
    nb = sum(n_blocks(t.size, h.block_size) for t in h.tensors)
    bits16 = (raw[:nb].astype(np.uint16) << 8) | raw[nb:2 * nb]
    if h.scale_dtype == "bfloat16":
        scales = (bits16.astype(np.uint32) << 16).view(np.float32)
    else:
        scales = bits16.view(np.float16).astype(np.float32)
    qmax = INT8_QMAX if h.bits == 8 else INT4_QMAX
    biggest = np.float32(np.finfo(np.float32).max / qmax)
    bad = ~((scales == 0) | ((scales >= MIN_SCALE) & (scales <= biggest)))
    bad |= (bits16 & 0x8000) != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError(f"scale of block {i} is {scales[i]!r}: not 0 or a positive value in "
                         f"[{MIN_SCALE:.3g}, float32 max / {qmax}]")
    codes = raw[2 * nb:].reshape(nb, code_bytes_per_block(h.bits, h.block_size))
    if h.bits == 8:
        codes = codes.view(np.int8)
    if impl != "numpy" and nb:
        fn = dequantize if impl == "jnp" else partial(dequantize_pallas, interpret=default_interpret())
        return np.array(fn(codes, scales, shape=(nb * h.block_size,), bits=h.bits,
                           codebook=h.codebook or "nf4"))
    out = np.empty((nb, h.block_size), np.float32)
    if h.bits == 8:
        np.multiply(codes, scales[:, None], out=out)
        return out.reshape(-1)
    lut_lo, lut_hi = _pair_luts(h.codebook)
    pairs = codes.view("<u2")
    half = h.block_size // 2
    out[:, :half].view("<u8")[...] = lut_lo[pairs]
    out[:, half:].view("<u8")[...] = lut_hi[pairs]
    out *= scales[:, None]
    return out.reshape(-1)


def _split(flat: np.ndarray, h: wire.Header) -> dict[str, np.ndarray]:
    out, pos = {}, 0
    for t in h.tensors:
        out[t.name] = flat[pos:pos + t.size].reshape(t.shape)
        pos += t.size if h.bits in (32, 16) else n_blocks(t.size, h.block_size) * h.block_size
    return out


def roundtrip(fragment: Mapping[str, Any], cfg: CodecConfig = CodecConfig(), *,
              key=None) -> tuple[dict[str, np.ndarray], int]:
    """(decode(encode(fragment)), encoded length in bytes): what a receiver gets."""
    data = encode(fragment, cfg, key=key)
    return decode(data), len(data)
