"""Frame stage: the fixed 32-byte header in front of every fragment payload.

    offset size field
         0    4 magic "WDFG" (FRAGMENT_MAGIC)
         4    1 format version (2)
         5    1 bits: 32, 16, 8 or 4
         6    1 flags: bit 0 = payload is zstd chunks (``entropy``: a table, then a frame per chunk)
         7    1 scale dtype id (bits 8/4, else 0): 1 bfloat16, 2 float16
         8    1 codebook id (bits 4, else 0): 1 nf4, 2 uniform
         9    1 reserved, 0
        10    2 block_size (bits 8/4, else 0)
        12    4 fragment index
        16    8 raw_len: payload bytes before zstd
        24    8 payload_len: bytes after the header

All integers little-endian. Version 2 (#26) cut the raw bytes into chunks zstd compresses on
their own and gave each chunk of 8/4-bit blocks its own scales (``chunks``); version 1 was one
zstd frame over the whole payload, with the scales of all blocks in front. The decoded values are
the same bits in both. Both ends know the fragment layout, so names and
shapes never travel, and no checksum either: the transport checks each whole
message (XXH3) and the simulator has no wire. ``parse_header`` checks every
field on its own and against the buffer's length; the codec then checks the
fragment index and raw_len against the layout.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from wan_diloco.compression.config import BITS, BLOCK_SIZE_RANGE, CODEBOOK_IDS, SCALE_DTYPE_IDS, Format
from wan_diloco.compression.errors import CodecError

FRAGMENT_MAGIC = b"WDFG"
FORMAT_VERSION = 2
FLAG_ZSTD = 1
_HEADER = struct.Struct("<4sBBBBBBHIQQ")
HEADER_BYTES = _HEADER.size
_SCALE_NAMES = {v: k for k, v in SCALE_DTYPE_IDS.items()}
_CODEBOOK_NAMES = {v: k for k, v in CODEBOOK_IDS.items()}


@dataclass(frozen=True)
class Header:
    fmt: Format
    zstd: bool
    fragment: int
    raw_len: int
    payload_len: int


def pack_header(h: Header) -> bytes:
    f = h.fmt
    return _HEADER.pack(
        FRAGMENT_MAGIC, FORMAT_VERSION, f.bits, FLAG_ZSTD if h.zstd else 0,
        SCALE_DTYPE_IDS.get(f.scale_dtype, 0), CODEBOOK_IDS.get(f.codebook, 0), 0,
        f.block_size, h.fragment, h.raw_len, h.payload_len)


def parse_header(data: memoryview) -> Header:
    """Validate the header of ``data`` (header + payload); CodecError names the bad field."""
    total = len(data)
    if total < HEADER_BYTES:
        raise CodecError(f"payload too short: {total} bytes, the header alone is {HEADER_BYTES}")
    (magic, version, bits, flags, scale_id, codebook_id, reserved, block_size, fragment,
     raw_len, payload_len) = _HEADER.unpack_from(data, 0)
    if magic != FRAGMENT_MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {FRAGMENT_MAGIC!r}: not a fragment payload")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported fragment format version {version}: this build reads version "
                         f"{FORMAT_VERSION} only (both ends of a run must run the same format)")
    if bits not in BITS:
        raise CodecError(f"bits: {bits} is not one of {', '.join(map(str, BITS))}")
    if flags & ~FLAG_ZSTD:
        raise CodecError(f"flags: unknown bits set in {flags:#04x}")
    if reserved:
        raise CodecError(f"reserved byte is {reserved}, must be 0")
    quantized = Format(bits).quantized
    if quantized:
        lo, hi = BLOCK_SIZE_RANGE
        if not (lo <= block_size <= hi and block_size & (block_size - 1) == 0):
            raise CodecError(f"block_size: {block_size} is not a power of two in [{lo}, {hi}]")
        if scale_id not in _SCALE_NAMES:
            raise CodecError(f"scale dtype: unknown id {scale_id}")
    elif block_size or scale_id:
        raise CodecError(f"block_size/scale dtype: must be 0 for {bits}-bit values, "
                         f"got {block_size}/{scale_id}")
    if bits == 4:
        if codebook_id not in _CODEBOOK_NAMES:
            raise CodecError(f"codebook: unknown id {codebook_id}")
    elif codebook_id:
        raise CodecError(f"codebook: must be 0 for {bits}-bit values, got {codebook_id}")
    if payload_len != total - HEADER_BYTES:
        raise CodecError(f"payload_len: header says {payload_len} bytes, "
                         f"{total - HEADER_BYTES} follow the header (truncated or oversized)")
    zstd = bool(flags & FLAG_ZSTD)
    # Stored zstd payloads are strictly smaller than their raw bytes (entropy.compress_chunks).
    if zstd and payload_len >= raw_len:
        raise CodecError(f"raw_len: {raw_len} bytes, not more than the {payload_len} zstd bytes")
    if not zstd and payload_len != raw_len:
        raise CodecError(f"raw_len: {raw_len} bytes, but {payload_len} are stored uncompressed")
    fmt = Format(bits, block_size, _SCALE_NAMES.get(scale_id), _CODEBOOK_NAMES.get(codebook_id))
    return Header(fmt, zstd, fragment, raw_len, payload_len)
