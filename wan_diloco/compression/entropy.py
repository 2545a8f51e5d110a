"""Entropy stage: zstd over a payload's raw bytes, with a bounded decompressor.

``compress`` keeps the zstd frame only when it is smaller than the raw bytes,
so a stored payload is never larger than its raw form; the header's zstd flag
says which one was stored.
"""
from __future__ import annotations

import zstandard

from wan_diloco.compression.errors import CodecError

_ZSTD_WRITE_BYTES = 1 << 22
# Quantized codes rarely compress past this ratio; more than that is
# all-zeros or a forgery, and gets no up-front allocation.
_PLAUSIBLE_ZSTD_RATIO = 64


def compress(raw: bytes, level: int) -> bytes | None:
    """The zstd frame of ``raw`` (content size recorded), or None when it is not smaller."""
    packed = zstandard.ZstdCompressor(level=level).compress(raw)
    return packed if len(packed) < len(raw) else None


def decompress(payload: memoryview, raw_len: int) -> bytes:
    """The ``raw_len`` bytes a zstd frame holds; CodecError if it holds anything else."""
    # The frame's own content size must match the header, and zstd stops at
    # it. Output is allocated up front only for a plausible ratio; past it,
    # decompressobj grows the output as data really decodes, so a forged
    # frame size cannot buy a large allocation.
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd frame header is invalid: {e}") from None
    if size != raw_len:
        raise CodecError(f"zstd frame declares {size} bytes, header says {raw_len}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if raw_len <= _PLAUSIBLE_ZSTD_RATIO * len(payload):
            out = dctx.decompress(payload, max_output_size=raw_len, allow_extra_data=False)
        else:
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
