"""Wire format of one encoded fragment (format version 1), and its validator.

    message  = header | payload | crc32 (u32)
    header   = fixed part (struct ``_FIXED``) | tensor table
    fixed    = magic "WDQC", version u16, bits u8, flags u8 (bit 0: zstd),
               scale dtype u8, codebook u8, block_size u32, n_tensors u32,
               raw_len u64 (payload before zstd), payload_len u64 (as stored),
               header_len u32
    table    = per tensor: name_len u16, UTF-8 name, dtype u8 (1 = float32),
               ndim u8, ndim x u64 dims
    payload  = bits 32: fp32 values | bits 16: bf16 values | bits 8/4: all
               scales as two byte planes (high bytes, then low bytes: the
               exponent plane compresses well) then all codes, tensors in
               table order, each padded to whole blocks

All integers are little-endian. The checksum is zlib's CRC-32 over everything
before it: it catches any burst error of up to 32 bits and random corruption
with probability 1 - 2^-32, runs at GB/s in the C zlib, and ships with
Python. It guards against accidents, not attackers; authenticity is the
transport's job (TLS). The validator therefore also checks every field, so a
forged message with a recomputed checksum still cannot reach numpy with a bad
length.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from wan_diloco.compression.config import (
    BLOCK_SIZE_RANGE, CODEBOOK_IDS, SCALE_DTYPE_IDS,
)
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks

MAGIC = b"WDQC"
VERSION = 1
FLAG_ZSTD = 1
DTYPE_FLOAT32 = 1
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 4096
MAX_NDIM = 16
DEFAULT_MAX_BYTES = 1 << 32
_FIXED = struct.Struct("<4sHBBBBIIQQI")
_CRC = struct.Struct("<I")
_MIN_ENTRY = 5  # name length, one name byte, dtype, ndim
_SCALE_NAMES = {v: k for k, v in SCALE_DTYPE_IDS.items()}
_CODEBOOK_NAMES = {v: k for k, v in CODEBOOK_IDS.items()}


class CodecError(ValueError):
    """A received message is malformed; the message says what was wrong."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    bits: int
    zstd: bool
    scale_dtype: str | None
    codebook: str | None
    block_size: int
    tensors: tuple[TensorSpec, ...]
    raw_len: int
    payload_len: int
    header_len: int


def payload_layout(bits: int, block_size: int, tensors: tuple[TensorSpec, ...]) -> tuple[int, int]:
    """-> (scale bytes, total raw payload bytes) for these tensors."""
    if bits in (32, 16):
        return 0, sum(t.size for t in tensors) * (bits // 8)
    blocks = sum(n_blocks(t.size, block_size) for t in tensors)
    return 2 * blocks, blocks * (2 + code_bytes_per_block(bits, block_size))


def pack_header(bits: int, zstd: bool, scale_dtype: str | None, codebook: str | None,
                block_size: int, tensors: tuple[TensorSpec, ...], raw_len: int,
                payload_len: int) -> bytes:
    table = bytearray()
    for t in tensors:
        name = t.name.encode("utf-8")
        table += struct.pack("<H", len(name)) + name
        table += struct.pack(f"<BB{len(t.shape)}Q", DTYPE_FLOAT32, len(t.shape), *t.shape)
    fixed = _FIXED.pack(
        MAGIC, VERSION, bits, FLAG_ZSTD if zstd else 0,
        SCALE_DTYPE_IDS.get(scale_dtype, 0), CODEBOOK_IDS.get(codebook, 0),
        block_size, len(tensors), raw_len, payload_len, _FIXED.size + len(table))
    return fixed + bytes(table)


def seal(header: bytes, payload_parts: list) -> bytes:
    """header | payload parts | crc32 over all of them, joined in one copy."""
    crc = zlib.crc32(header)
    for part in payload_parts:
        crc = zlib.crc32(part, crc)
    return b"".join([header, *payload_parts, _CRC.pack(crc)])


def _fail(what: str):
    raise CodecError(what)


def parse_header(data: memoryview, max_bytes: int) -> Header:
    """Validate everything except the payload's contents; never allocates more than the table."""
    total = len(data)
    if total > max_bytes:
        _fail(f"message is {total} bytes, over the limit of {max_bytes}")
    if total < _FIXED.size + _CRC.size:
        _fail(f"message too short: {total} bytes, a header alone needs {_FIXED.size + _CRC.size}")
    (magic, version, bits, flags, scale_id, codebook_id, block_size, n_tensors, raw_len,
     payload_len, header_len) = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        _fail(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a wan-diloco fragment")
    if version != VERSION:
        _fail(f"unsupported format version {version}, this build reads {VERSION}")
    (crc,) = _CRC.unpack_from(data, total - _CRC.size)
    if zlib.crc32(data[:total - _CRC.size]) != crc:
        _fail("checksum mismatch: message corrupted")
    if bits not in (32, 16, 8, 4):
        _fail(f"bits: {bits} is not one of 32, 16, 8, 4")
    if flags & ~FLAG_ZSTD:
        _fail(f"flags: unknown bits set in {flags:#04x}")
    quantized = bits in (8, 4)
    if quantized:
        lo, hi = BLOCK_SIZE_RANGE
        if not (lo <= block_size <= hi and block_size & (block_size - 1) == 0):
            _fail(f"block_size: {block_size} is not a power of two in [{lo}, {hi}]")
        if scale_id not in _SCALE_NAMES:
            _fail(f"scale dtype: unknown id {scale_id}")
    elif block_size or scale_id:
        _fail(f"block_size/scale dtype: must be 0 for {bits}-bit values, got {block_size}/{scale_id}")
    if bits == 4:
        if codebook_id not in _CODEBOOK_NAMES:
            _fail(f"codebook: unknown id {codebook_id}")
    elif codebook_id:
        _fail(f"codebook: must be 0 for {bits}-bit values, got {codebook_id}")
    if not _FIXED.size <= header_len <= total - _CRC.size:
        _fail(f"header_len: {header_len} outside [{_FIXED.size}, {total - _CRC.size}]")
    if header_len + payload_len + _CRC.size != total:
        _fail(f"payload_len: header {header_len} + payload {payload_len} + crc {_CRC.size} "
              f"!= message length {total}")
    if n_tensors > MAX_TENSORS or n_tensors * _MIN_ENTRY > header_len - _FIXED.size:
        _fail(f"n_tensors: {n_tensors} cannot fit in a {header_len}-byte header")
    tensors = _parse_table(data[:header_len], n_tensors, max_bytes)
    _, want_raw = payload_layout(bits, block_size, tensors)
    if raw_len != want_raw:
        _fail(f"raw_len: header says {raw_len} bytes, the tensor table needs {want_raw}")
    decoded = 4 * sum(t.size for t in tensors)
    if decoded > max_bytes or raw_len > max_bytes:
        _fail(f"decoded size {decoded} bytes is over the limit of {max_bytes}")
    zstd = bool(flags & FLAG_ZSTD)
    if not zstd and payload_len != raw_len:
        _fail(f"payload_len: {payload_len} bytes stored uncompressed, expected {raw_len}")
    return Header(bits, zstd, _SCALE_NAMES.get(scale_id) if quantized else None,
                  _CODEBOOK_NAMES.get(codebook_id) if bits == 4 else None,
                  block_size, tensors, raw_len, payload_len, header_len)


def _parse_table(table: memoryview, n_tensors: int, max_bytes: int) -> tuple[TensorSpec, ...]:
    pos = _FIXED.size
    end = len(table)
    max_elems = max_bytes // 4
    tensors, seen = [], set()

    def take(n: int, what: str, i: int) -> memoryview:
        nonlocal pos
        if pos + n > end:
            _fail(f"tensor table entry {i}: {what} runs past the header end ({pos + n} > {end})")
        out = table[pos:pos + n]
        pos += n
        return out

    for i in range(n_tensors):
        (name_len,) = struct.unpack("<H", take(2, "name length", i))
        if not 0 < name_len <= MAX_NAME_BYTES:
            _fail(f"tensor table entry {i}: name length {name_len} outside [1, {MAX_NAME_BYTES}]")
        try:
            name = bytes(take(name_len, "name", i)).decode("utf-8")
        except UnicodeDecodeError:
            _fail(f"tensor table entry {i}: name is not valid UTF-8")
        if name in seen:
            _fail(f"tensor {name!r}: duplicate name")
        seen.add(name)
        dtype, ndim = struct.unpack("<BB", take(2, "dtype/ndim", i))
        if dtype != DTYPE_FLOAT32:
            _fail(f"tensor {name!r}: unknown dtype id {dtype}")
        if ndim > MAX_NDIM:
            _fail(f"tensor {name!r}: ndim {ndim} over the limit of {MAX_NDIM}")
        shape = struct.unpack(f"<{ndim}Q", take(8 * ndim, "dims", i))
        spec = TensorSpec(name, tuple(shape))
        # Python ints do not overflow, so a forged dim is caught here, not in numpy.
        if spec.size > max_elems:
            _fail(f"tensor {name!r}: shape {spec.shape} over the size limit of {max_bytes} bytes")
        tensors.append(spec)
    if pos != end:
        _fail(f"tensor table: {end - pos} unexpected bytes after the last entry")
    return tuple(tensors)
