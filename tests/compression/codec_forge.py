"""Helpers for tests that forge wire messages (with a valid checksum)."""
import struct
import zlib

FIXED = struct.Struct("<4sHBBBBIIQQI")
FIELDS = ("magic", "version", "bits", "flags", "scale_dtype", "codebook", "block_size",
          "n_tensors", "raw_len", "payload_len", "header_len")
WIDTHS = dict(zip(FIELDS, (4, 2, 1, 1, 1, 1, 4, 4, 8, 8, 4)))  # bytes per field


def reseal(body: bytes) -> bytes:
    """Append a correct CRC-32, so only the field validator can reject the body."""
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def fields(msg: bytes) -> dict:
    return dict(zip(FIELDS, FIXED.unpack_from(msg, 0)))


def with_fields(msg: bytes, **changes) -> bytes:
    f = fields(msg)
    f.update(changes)
    return reseal(FIXED.pack(*(f[k] for k in FIELDS)) + msg[FIXED.size:-4])


def dim_offsets(msg: bytes) -> list[int]:
    """Byte offsets of every u64 dim in the tensor table."""
    f = fields(msg)
    pos, out = FIXED.size, []
    for _ in range(f["n_tensors"]):
        (name_len,) = struct.unpack_from("<H", msg, pos)
        pos += 2 + name_len
        _, ndim = struct.unpack_from("<BB", msg, pos)
        pos += 2
        out += [pos + 8 * i for i in range(ndim)]
        pos += 8 * ndim
    return out


def body_with(msg: bytes, offset: int, raw: bytes) -> bytes:
    """Overwrite bytes at ``offset`` and reseal."""
    body = bytearray(msg[:-4])
    body[offset:offset + len(raw)] = raw
    return reseal(bytes(body))
