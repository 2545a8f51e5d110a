"""Helpers for tests that forge fragment payloads (the fixed header of ``compression.frame``)."""
import struct

HEADER = struct.Struct("<4sBBBBBBHIQQ")
FIELDS = ("magic", "version", "bits", "flags", "scale_dtype", "codebook", "reserved", "block_size",
          "fragment", "raw_len", "payload_len")
WIDTHS = dict(zip(FIELDS, (4, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8)))  # bytes per field


def fields(msg: bytes) -> dict:
    return dict(zip(FIELDS, HEADER.unpack_from(msg, 0)))


def with_fields(msg: bytes, **changes) -> bytes:
    """``msg`` with header fields replaced (values taken modulo their width)."""
    f = fields(msg)
    for k, v in changes.items():
        f[k] = v if k == "magic" else v % (1 << (8 * WIDTHS[k]))
    return HEADER.pack(*(f[k] for k in FIELDS)) + msg[HEADER.size:]


def body(msg: bytes) -> bytes:
    return msg[HEADER.size:]


def with_body(msg: bytes, new_body: bytes, **changes) -> bytes:
    """Header of ``msg`` (payload_len fixed up, then ``changes``) in front of ``new_body``."""
    return with_fields(msg[:HEADER.size] + new_body, **{"payload_len": len(new_body), **changes})


def patched(msg: bytes, offset: int, raw: bytes) -> bytes:
    """Overwrite bytes at ``offset``."""
    out = bytearray(msg)
    out[offset:offset + len(raw)] = raw
    return bytes(out)
