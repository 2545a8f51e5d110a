"""Fuzz ``decode``: random, mutated and forged messages only ever raise CodecError.

Three property tests, 2,200 examples in all. Mutations start from valid
encodings of every format; forged messages get a recomputed checksum, so the
field validator, not the CRC, has to reject them.
"""
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from .codec_forge import FIELDS, FIXED, WIDTHS, dim_offsets, fields, reseal
from wan_diloco.compression import CodecConfig, CodecError, decode, encode

_RNG = np.random.default_rng(7)
_FRAG = {
    "w": _RNG.standard_normal((5, 7)).astype(np.float32),
    "b": _RNG.standard_normal(3).astype(np.float32) * 1e-3,
    "s": np.float32(1.5),
    "e": np.zeros((0,), np.float32),
}
SEEDS = [encode(_FRAG, CodecConfig(bits=bits, block_size=16, zstd=z, int4_codebook=cb))
         for bits, cb in [(32, "nf4"), (16, "nf4"), (8, "nf4"), (4, "nf4"), (4, "uniform")]
         for z in (False, True)]
LIMIT = 1 << 22  # small max_bytes: forged sizes hit the limit instead of allocating
INTERESTING = [0, 1, 2, 3, 4, 7, 15, 16, 31, 32, 64, 127, 255, 256, 4095, 4096, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _check(msg: bytes, max_bytes=LIMIT):
    try:
        out = decode(msg, max_bytes=max_bytes)
    except CodecError as e:
        assert str(e), "CodecError without a message"
        return
    assert isinstance(out, dict)
    for name, arr in out.items():
        assert isinstance(name, str) and arr.dtype == np.float32
        assert np.isfinite(arr).all(), f"decoded NaN/Inf in {name!r}"


@settings(max_examples=600, **SETTINGS)
@given(st.binary(max_size=400), st.sampled_from(["raw", "magic", "magic+crc"]))
def test_random_bytes(blob, kind):
    if kind != "raw":
        blob = b"WDQC\x01\x00" + blob
    if kind == "magic+crc":
        blob = reseal(blob)
    _check(blob)


_OPS = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10**4)),
    st.tuples(st.just("flip"), st.integers(0, 10**4), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**4), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10**4), st.integers(1, 32)),
    st.tuples(st.just("u64"), st.integers(0, 10**4), st.sampled_from(INTERESTING)),
    st.tuples(st.just("u32"), st.integers(0, 10**4), st.integers(0, 2**32 - 1)),
)


def _apply(msg: bytearray, op) -> bytearray:
    kind, at = op[0], op[1] % (len(msg) + 1)
    if kind == "truncate":
        return msg[:at]
    if kind == "flip" and at < len(msg):
        msg[at] ^= op[2]
    elif kind == "insert":
        msg[at:at] = op[2]
    elif kind == "delete":
        del msg[at:at + op[2]]
    elif kind in ("u64", "u32"):
        fmt = "<Q" if kind == "u64" else "<I"
        raw = struct.pack(fmt, op[2] % (2**64 if kind == "u64" else 2**32))
        msg[at:at + len(raw)] = raw
    return msg


@settings(max_examples=800, **SETTINGS)
@given(st.sampled_from(SEEDS), st.lists(_OPS, min_size=1, max_size=4), st.booleans())
def test_mutated_valid_messages(seed, ops, recompute_crc):
    msg = bytearray(seed)
    for op in ops:
        msg = _apply(msg, op)
    if recompute_crc and len(msg) >= 4:
        msg = bytearray(reseal(bytes(msg[:-4])))
    _check(bytes(msg))


@settings(max_examples=800, **SETTINGS)
@given(st.sampled_from(SEEDS), st.sampled_from(FIELDS[1:] + ("dim",)), st.sampled_from(INTERESTING),
       st.integers(0, 64), st.sampled_from([LIMIT, None]))
def test_forged_fields_with_valid_checksum(seed, field, value, which, max_bytes):
    f = fields(seed)
    if field == "dim":
        offs = dim_offsets(seed)
        at = offs[which % len(offs)]
        body = bytearray(seed[:-4])
        body[at:at + 8] = struct.pack("<Q", value % 2**64)
    else:
        f[field] = value % (1 << (8 * WIDTHS[field]))
        body = bytearray(FIXED.pack(*(f[k] for k in FIELDS)) + seed[FIXED.size:-4])
    _check(reseal(bytes(body)), max_bytes=max_bytes)


def test_seeds_decode():
    for msg in SEEDS:
        out = decode(msg)
        assert out["w"].shape == (5, 7) and out["e"].shape == (0,)
