"""encode/decode: round trips, rejected input, and a validator that names what was wrong."""
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .codec_forge import FIXED, body_with, dim_offsets, fields, reseal, with_fields
from wan_diloco.compression import (
    CodecConfig, CodecError, EncodeError, NonFiniteError, decode, encode, roundtrip,
)
from wan_diloco.config import ConfigError, from_mapping

B = 32
RNG = np.random.default_rng(0)
FRAG = {
    "block_0/attn/qkv/kernel": RNG.standard_normal((9, 13)).astype(np.float32),
    "zeros": np.zeros(70, np.float32),
    "scalar": np.float32(-2.5),
    "empty": np.zeros((0, 3), np.float32),
    "huge": (RNG.standard_normal(40) * 1e35).astype(np.float32),
    "tiny": (RNG.standard_normal(40) * 1e-33).astype(np.float32),
}
MAX_REL = {32: 0.0, 16: 2.0**-8, 8: 0.01, 4: 0.12}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("zstd", [True, False])
def test_roundtrip_every_format(bits, zstd):
    cfg = CodecConfig(bits=bits, block_size=B, zstd=zstd, impl="jnp")
    out, nbytes = roundtrip(FRAG, cfg)
    assert list(out) == list(FRAG)
    for name, x in FRAG.items():
        assert out[name].dtype == np.float32 and out[name].shape == np.shape(x), name
        assert _rel(out[name], x) <= MAX_REL[bits], name
    np.testing.assert_array_equal(out["zeros"], 0)
    assert nbytes == len(encode(FRAG, cfg))


def test_large_and_batched_small_tensors_keep_their_order():
    rng = np.random.default_rng(5)
    frag = {"s1": rng.standard_normal(10).astype(np.float32) * 1e-3,
            "big": rng.standard_normal((70, 1000)).astype(np.float32),  # quantized on its own
            "s2": rng.standard_normal((3, 3)).astype(np.float32) * 1e3,
            "s3": np.zeros(0, np.float32)}
    out, _ = roundtrip(frag, CodecConfig(bits=4, block_size=B))
    assert list(out) == list(frag)
    for name, x in frag.items():
        assert out[name].shape == x.shape and _rel(out[name], x) <= MAX_REL[4], name


def test_encoding_and_decoding_are_deterministic():
    cfg = CodecConfig(bits=4, block_size=B)
    jfrag = {k: jnp.asarray(v) for k, v in FRAG.items()}
    a, b = encode(FRAG, cfg), encode(jfrag, cfg)
    assert a == b
    d1, d2 = decode(a), decode(bytearray(a))
    d3 = decode(memoryview(a))
    for k in FRAG:
        assert d1[k].tobytes() == d2[k].tobytes() == d3[k].tobytes()
    d1["zeros"][0] = 1.0  # outputs are writable and independent of the input
    assert decode(a)["zeros"][0] == 0


def test_stochastic_rounding_needs_a_key_and_varies_with_it():
    cfg = CodecConfig(bits=4, block_size=B, stochastic_rounding=True)
    with pytest.raises(EncodeError, match="PRNG key"):
        encode(FRAG, cfg)
    a = encode(FRAG, cfg, key=jax.random.key(0))
    assert a == encode(FRAG, cfg, key=jax.random.key(0))
    assert a != encode(FRAG, cfg, key=jax.random.key(1))
    assert _rel(decode(a)["huge"], FRAG["huge"]) < 0.2


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected_naming_the_tensor(bits, bad):
    frag = dict(FRAG)
    w = np.ones(50, np.float32)
    w[17] = bad
    frag["layer/w"] = w
    with pytest.raises(NonFiniteError, match="'layer/w'.*NaN/Inf") as e:
        encode(frag, CodecConfig(bits=bits, block_size=B))
    assert isinstance(e.value, ValueError)


def test_scale_and_value_overflow_is_rejected():
    frag = {"w": np.full(40, 1e10, np.float32)}
    with pytest.raises(NonFiniteError, match="'w'.*float16 scale"):
        encode(frag, CodecConfig(bits=8, block_size=B, scale_dtype="float16"))
    with pytest.raises(NonFiniteError, match="'w'.*bfloat16"):
        encode({"w": np.full(4, 3.4e38, np.float32)}, CodecConfig(bits=16))


@pytest.mark.parametrize("frag,match", [
    ([1, 2], "must map names"),
    ({"": np.zeros(3, np.float32)}, "non-empty"),
    ({7: np.zeros(3, np.float32)}, "non-empty"),
    ({"a\ud800": np.zeros(3, np.float32)}, "non-empty"),
    ({"i": np.zeros(3, np.int32)}, "'i': dtype int32"),
    ({"d": np.zeros(3, np.float64)}, "'d': dtype float64"),
])
def test_bad_fragments_are_rejected(frag, match):
    with pytest.raises(EncodeError, match=match):
        encode(frag, CodecConfig(bits=8))


def test_config_validation_names_the_field():
    for bad, field in [({"bits": 6}, "bits"), ({"block_size": 48}, "block_size"),
                       ({"block_size": 8192}, "block_size"), ({"zstd_level": 40}, "zstd_level"),
                       ({"scale_dtype": "float32"}, "scale_dtype"), ({"impl": "cuda"}, "impl")]:
        with pytest.raises(ConfigError, match=field):
            from_mapping(CodecConfig, bad)
    with pytest.raises(EncodeError, match="bits"):
        encode(FRAG, CodecConfig(bits=6))
    assert from_mapping(CodecConfig, {"bits": 4, "block_size": 64}).block_size == 64


# ------------------------------------------------------------ malformed input
def _msg(bits=8, zstd=False):
    return encode({"a": FRAG["block_0/attn/qkv/kernel"], "b": FRAG["huge"]},
                  CodecConfig(bits=bits, block_size=B, zstd=zstd))


def test_wrong_types_and_short_messages():
    with pytest.raises(CodecError, match="expected bytes"):
        decode("not bytes")
    with pytest.raises(CodecError, match="too short"):
        decode(b"WDQC")
    msg = _msg()
    with pytest.raises(CodecError, match="bad magic"):
        decode(b"XXXX" + msg[4:])
    with pytest.raises(CodecError, match="version"):
        decode(with_fields(msg, version=2))


@pytest.mark.parametrize("cut", [1, 4, 17, 100])
def test_truncation_and_corruption_fail_the_checksum(cut):
    msg = _msg(zstd=True)
    with pytest.raises(CodecError):
        decode(msg[:-cut])
    flipped = bytearray(msg)
    flipped[-cut - 4] ^= 0x40
    with pytest.raises(CodecError, match="checksum"):
        decode(bytes(flipped))


@pytest.mark.parametrize("change,match", [
    (dict(bits=5), "bits"),
    (dict(flags=2), "flags"),
    (dict(block_size=48), "block_size"),
    (dict(scale_dtype=9), "scale dtype"),
    (dict(codebook=1), "codebook"),
    (dict(n_tensors=1 << 30), "n_tensors"),
    (dict(n_tensors=3), "n_tensors|table"),
    (dict(raw_len=1 << 62), "raw_len"),
    (dict(payload_len=5), "payload_len"),
    (dict(header_len=1 << 31), "header_len"),
    (dict(header_len=FIXED.size + 3), "payload_len"),
])
def test_forged_header_fields_are_named(change, match):
    with pytest.raises(CodecError, match=match):
        decode(with_fields(_msg(), **change))


def test_header_len_that_cuts_the_table():
    msg = _msg()
    f = fields(msg)
    forged = with_fields(msg, header_len=f["header_len"] - 3, payload_len=f["payload_len"] + 3)
    with pytest.raises(CodecError, match="runs past the header end"):
        decode(forged)


@pytest.mark.parametrize("dim", [1 << 40, (1 << 64) - 1, 0, 10])
def test_forged_dims_never_reach_numpy(dim):
    msg = _msg(bits=4, zstd=True)
    off = dim_offsets(msg)[0]
    with pytest.raises(CodecError, match="size limit|raw_len"):
        decode(body_with(msg, off, struct.pack("<Q", dim)), max_bytes=1 << 20)


def test_forged_table_entries():
    msg = _msg()
    name_at = FIXED.size + 2
    with pytest.raises(CodecError, match="UTF-8"):
        decode(body_with(msg, name_at, b"\xff"))
    with pytest.raises(CodecError, match="duplicate"):
        decode(body_with(msg, name_at + 1 + 2 + 8 * 2 + 2, b"a"))  # second name "b" -> "a"
    with pytest.raises(CodecError, match="dtype"):
        decode(body_with(msg, name_at + 1, b"\x07"))
    with pytest.raises(CodecError, match="ndim"):
        decode(body_with(msg, name_at + 2, b"\xff"))
    with pytest.raises(CodecError, match="name length"):
        decode(body_with(msg, FIXED.size, b"\x00\x00"))


def test_forged_zstd_payloads():
    msg = _msg(zstd=True)
    f = fields(msg)
    header, payload = msg[:f["header_len"]], msg[f["header_len"]:-4]
    extra = with_fields(reseal(header + payload + b"\0"), payload_len=f["payload_len"] + 1)
    with pytest.raises(CodecError, match="unused data"):
        decode(extra)
    junk = reseal(header + bytes(len(payload)))
    with pytest.raises(CodecError, match="zstd"):
        decode(junk)


def test_forged_scales_and_values_are_rejected():
    msg = _msg(bits=8, zstd=False)
    start = fields(msg)["header_len"]
    n_blocks = -(-117 // B) + -(-40 // B)
    for hi, lo, what in [(0x7F, 0xC0, "nan"), (0x00, 0x01, "subnormal"), (0x80, 0x00, "negative"),
                         (0x7F, 0x7F, "too big for 127 * scale")]:
        body = bytearray(msg[:-4])
        body[start] = hi
        body[start + n_blocks] = lo
        with pytest.raises(CodecError, match="scale of block 0"):
            decode(reseal(bytes(body)))
    raw16 = encode({"v": np.ones(4, np.float32)}, CodecConfig(bits=16, zstd=False))
    start = fields(raw16)["header_len"]
    with pytest.raises(CodecError, match="NaN/Inf"):
        decode(body_with(raw16, start, b"\x80\x7f"))


def test_max_bytes_bounds_message_and_output():
    msg = _msg(bits=4, zstd=True)
    with pytest.raises(CodecError, match="over the limit"):
        decode(msg, max_bytes=len(msg) - 1)
    with pytest.raises(CodecError, match="size limit"):
        decode(msg, max_bytes=len(msg) + 10)  # decoded floats need more than that
    assert set(decode(msg, max_bytes=4096)) == {"a", "b"}


def test_highly_compressible_payloads_decode_incrementally():
    msg = encode({"z": np.zeros(1 << 16, np.float32)}, CodecConfig(bits=8))
    f = fields(msg)
    assert f["raw_len"] > 64 * f["payload_len"]  # takes the incremental zstd path
    np.testing.assert_array_equal(decode(msg)["z"], 0)
    header, payload = msg[:f["header_len"]], msg[f["header_len"]:-4]
    extra = with_fields(reseal(header + payload + b"\0"), payload_len=f["payload_len"] + 1)
    with pytest.raises(CodecError, match="after the zstd frame"):
        decode(extra)
    short = with_fields(reseal(header + payload[:-1]), payload_len=f["payload_len"] - 1)
    with pytest.raises(CodecError, match="zstd"):
        decode(short)
