"""Fuzz ``FragmentCodec.decode``: random, mutated and forged payloads only ever raise CodecError.

Three property tests, 2,200 examples in all. Mutations start from valid
encodings of every format. There is no checksum, so a mutation that keeps
every field consistent may decode: then the result must still be the
layout's tensors, float32 and finite.
"""
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from .codec_forge import FIELDS, HEADER, WIDTHS, fields
from wan_diloco.compression import FRAGMENT_MAGIC, CodecConfig, CodecError, FragmentCodec
from wan_diloco.fragments import Layout
from wan_diloco.merge import sum_squares

_RNG = np.random.default_rng(7)
_FRAG = {
    "w": _RNG.standard_normal((5, 7)).astype(np.float32),
    "b": _RNG.standard_normal(3).astype(np.float32) * 1e-3,
    "s": np.float32(1.5),
    "e": np.zeros((0,), np.float32),
}
LAYOUT = Layout([tuple(_FRAG), ("x",)], {**{k: np.shape(v) for k, v in _FRAG.items()}, "x": (40,)})
CONFIGS = [CodecConfig(bits=bits, block_size=16, zstd=z, int4_codebook=cb)
           for bits, cb in [(32, "nf4"), (16, "nf4"), (8, "nf4"), (4, "nf4"), (4, "uniform")]
           for z in (False, True)]
CODECS = [FragmentCodec(cfg, LAYOUT) for cfg in CONFIGS]
SEEDS = [(c, c.encode(_FRAG)) for c in CODECS]
INTERESTING = [0, 1, 2, 3, 4, 7, 15, 16, 31, 32, 64, 127, 255, 256, 4095, 4096, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _check(codec: FragmentCodec, fragment: int, msg: bytes):
    try:
        out = codec.decode(fragment, msg)
    except CodecError as e:
        assert str(e), "CodecError without a message"
        with pytest.raises(CodecError):  # a syncer's deferred decode refuses it too
            codec.decode(fragment, msg, deferred=True)
        return
    kept = codec.decode(fragment, msg, deferred=True)  # kept in its codes: the same checks, sums and values
    assert list(kept) == list(out) and kept.sum_squares.tobytes() == sum_squares(list(out.values())).tobytes()
    assert all(kept[n].tobytes() == out[n].tobytes() for n in out)
    names = LAYOUT.fragments[fragment]
    assert list(out) == list(names)
    for name, arr in out.items():
        assert arr.dtype == np.float32 and arr.shape == LAYOUT.shapes[name]
        assert np.isfinite(arr).all(), f"decoded NaN/Inf in {name!r}"


@settings(max_examples=600, **SETTINGS)
@given(st.binary(max_size=400), st.booleans(), st.sampled_from(CODECS), st.integers(0, 1))
def test_random_bytes(blob, with_magic, codec, fragment):
    if with_magic:
        blob = FRAGMENT_MAGIC + b"\x01" + blob
    _check(codec, fragment, blob)


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
def test_mutated_valid_payloads(seed, ops, fix_length):
    codec, msg = seed[0], bytearray(seed[1])
    for op in ops:
        msg = _apply(msg, op)
    if fix_length and len(msg) >= HEADER.size:
        # Keep payload_len consistent, so deeper checks (raw_len, zstd, scales) get exercised.
        msg[24:32] = struct.pack("<Q", len(msg) - HEADER.size)
    _check(codec, 0, bytes(msg))


@settings(max_examples=800, **SETTINGS)
@given(st.sampled_from(SEEDS), st.sampled_from(FIELDS[1:]), st.sampled_from(INTERESTING),
       st.integers(0, 1))
def test_forged_header_fields(seed, field, value, fragment):
    codec, msg = seed
    f = fields(msg)
    f[field] = value % (1 << (8 * WIDTHS[field]))
    _check(codec, fragment, HEADER.pack(*(f[k] for k in FIELDS)) + msg[HEADER.size:])


def test_seeds_decode():
    for codec, msg in SEEDS:
        out = codec.decode(0, msg)
        assert out["w"].shape == (5, 7) and out["e"].shape == (0,)
