"""FragmentCodec: round trips for every format, refused values, and a decoder that names what was wrong."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .codec_forge import HEADER, body, fields, patched, with_body, with_fields
from wan_diloco.compression import (
    FRAGMENT_MAGIC, HEADER_BYTES, CodecConfig, CodecError, EncodeError, FragmentCodec, NonFiniteError,
)
from wan_diloco.config import ConfigError
from wan_diloco.fragments import LazyValues, Layout

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
OTHER = {"other/w": RNG.standard_normal((4, 5)).astype(np.float32)}
LAYOUT = Layout([tuple(FRAG), tuple(OTHER)], {k: np.shape(v) for k, v in {**FRAG, **OTHER}.items()})
MAX_REL = {32: 0.0, 16: 2.0**-8, 8: 0.01, 4: 0.12}


def codec(**kw) -> FragmentCodec:
    return FragmentCodec(CodecConfig(**{"block_size": B, "impl": "jnp", **kw}), LAYOUT)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("zstd", [True, False])
def test_roundtrip_every_format(bits, zstd):
    c = codec(bits=bits, zstd=zstd)
    enc = c.roundtrip(dict(reversed(FRAG.items())))  # any order in, layout order out
    assert list(enc.values) == list(FRAG) and enc.nbytes == len(enc.payload)
    out = c.decode(0, enc.payload)
    for name, x in FRAG.items():
        assert out[name].dtype == np.float32 and out[name].shape == np.shape(x), name
        assert out[name].tobytes() == enc.values[name].tobytes(), name  # roundtrip == decode, bit for bit
        assert _rel(out[name], x) <= MAX_REL[bits], name
    np.testing.assert_array_equal(out["zeros"], 0)
    assert enc.payload == c.encode(FRAG)
    h = fields(enc.payload)
    assert h["magic"] == FRAGMENT_MAGIC and h["bits"] == bits and h["fragment"] == 0
    assert h["payload_len"] == len(enc.payload) - HEADER_BYTES == (h["payload_len"] if zstd else h["raw_len"])


def test_fp32_is_the_raw_little_endian_bytes_and_decodes_to_views():
    c = codec(bits=32, zstd=False)
    data = c.encode(FRAG)
    assert HEADER_BYTES == HEADER.size == 32
    assert body(data) == b"".join(np.asarray(x, "<f4").tobytes() for x in FRAG.values())
    h = fields(data)
    assert (h["flags"], h["block_size"], h["scale_dtype"], h["codebook"]) == (0, 0, 0, 0)
    out = c.decode(0, data)
    w = out["block_0/attn/qkv/kernel"]
    assert not w.flags.writeable and not w.flags.owndata  # a view into the payload, no copy
    np.testing.assert_array_equal(w, FRAG["block_0/attn/qkv/kernel"])
    # Fields that do not apply to 32 bits never reach the bytes.
    assert data == FragmentCodec(CodecConfig(bits=32, zstd=False, block_size=64, int4_codebook="uniform",
                                             scale_dtype="float16"), LAYOUT).encode(FRAG)


def test_zstd_is_kept_only_when_it_helps():
    noise = {"other/w": np.random.default_rng(9).standard_normal((4, 5)).astype(np.float32)}
    data = codec(bits=32, zstd=True).encode(noise)  # 80 random bytes: zstd cannot shrink them
    assert fields(data)["flags"] == 0 and len(data) == HEADER_BYTES + 80
    zeros = codec(bits=32, zstd=True).encode({"other/w": np.zeros((4, 5), np.float32)})
    assert fields(zeros)["flags"] == 1 and len(zeros) < HEADER_BYTES + 80


def test_large_and_batched_small_tensors_keep_their_order():
    rng = np.random.default_rng(5)
    frag = {"s1": rng.standard_normal(10).astype(np.float32) * 1e-3,
            "big": rng.standard_normal((70, 1000)).astype(np.float32),  # quantized on its own
            "s2": rng.standard_normal((3, 3)).astype(np.float32) * 1e3,
            "s3": np.zeros(0, np.float32)}
    c = FragmentCodec(CodecConfig(bits=4, block_size=B), Layout([tuple(frag)], {k: v.shape for k, v in frag.items()}))
    out = c.roundtrip(frag).values
    assert list(out) == list(frag)
    for name, x in frag.items():
        assert out[name].shape == x.shape and _rel(out[name], x) <= MAX_REL[4], name


def test_encoding_and_decoding_are_deterministic_and_decode_is_read_only():
    c = codec(bits=4)
    jfrag = {k: jnp.asarray(v) for k, v in FRAG.items()}
    a = c.encode(FRAG)
    assert a == c.encode(jfrag)
    d1, d2, d3 = c.decode(0, a), c.decode(0, bytearray(a)), c.decode(0, memoryview(a))
    for k in FRAG:
        assert d1[k].tobytes() == d2[k].tobytes() == d3[k].tobytes()
    with pytest.raises(ValueError, match="read-only"):
        d1["zeros"][0] = 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_float_inputs(dtype):
    frag = {"other/w": jnp.asarray(OTHER["other/w"], dtype)}
    out = codec(bits=32).roundtrip(frag).values["other/w"]
    np.testing.assert_array_equal(out, np.asarray(frag["other/w"], np.float32))


def test_stochastic_rounding_needs_a_key_and_varies_with_it():
    c = codec(bits=4, stochastic_rounding=True)
    with pytest.raises(EncodeError, match="PRNG key"):
        c.encode(FRAG)
    a = c.encode(FRAG, key=jax.random.key(0))
    assert a == c.encode(FRAG, key=jax.random.key(0))
    assert a != c.encode(FRAG, key=jax.random.key(1))
    enc = c.roundtrip(FRAG, key=jax.random.key(0))
    assert enc.payload == a and _rel(enc.values["huge"], FRAG["huge"]) < 0.2
    # Unquantized formats have nothing to round stochastically: no key needed.
    assert codec(bits=16, stochastic_rounding=True).encode(FRAG)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_naming_the_tensor(bits, bad):
    frag = dict(FRAG)
    w = np.ones(117, np.float32)
    w[17] = bad
    frag["block_0/attn/qkv/kernel"] = w.reshape(9, 13)
    with pytest.raises(NonFiniteError, match="'block_0/attn/qkv/kernel'.*NaN/Inf") as e:
        codec(bits=bits).encode(frag)
    assert isinstance(e.value, CodecError) and isinstance(e.value, ValueError)


def test_scale_and_value_overflow_is_refused():
    with pytest.raises(NonFiniteError, match="'other/w'.*float16 scale"):
        codec(bits=8, scale_dtype="float16").encode({"other/w": np.full((4, 5), 1e10, np.float32)})
    with pytest.raises(NonFiniteError, match="'other/w'.*bfloat16"):
        codec(bits=16).encode({"other/w": np.full((4, 5), 3.4e38, np.float32)})


@pytest.mark.parametrize("values,match", [
    ([1, 2], "must map tensor names"),
    ({}, "no tensors"),
    ({"nope": np.zeros(3, np.float32)}, "'nope' belongs to no fragment"),
    ({"zeros": FRAG["zeros"]}, r"fragment 0: wrong tensor set \(missing \['block_0"),
    ({**FRAG, "other/w": OTHER["other/w"]}, r"unexpected \['other/w'\]"),
    ({**FRAG, "nope": 1.0}, r"unexpected \['nope'\]"),
    ({"other/w": np.zeros((5, 4), np.float32)}, r"'other/w': shape \(5, 4\), expected \(4, 5\)"),
    ({"other/w": np.zeros((4, 5), np.int32)}, "'other/w': dtype int32"),
    ({"other/w": np.zeros((4, 5), np.float64)}, "'other/w': dtype float64"),
])
def test_bad_values_are_refused(values, match):
    with pytest.raises(EncodeError, match=match):
        codec(bits=8).encode(values)


def test_config_is_validated_naming_the_field():
    for bad, field in [({"bits": 6}, "bits"), ({"block_size": 48}, "block_size"),
                       ({"block_size": 8192}, "block_size"), ({"zstd_level": 40}, "zstd_level"),
                       ({"scale_dtype": "float32"}, "scale_dtype"), ({"impl": "cuda"}, "impl")]:
        with pytest.raises(ConfigError, match=field):
            FragmentCodec(CodecConfig(**bad), LAYOUT)
    assert CodecConfig().bits == 32


# ------------------------------------------------------------ malformed payloads
def _msg(bits=8, zstd=False):
    return codec(bits=bits, zstd=zstd).encode(FRAG)


def test_wrong_fragment_types_and_short_payloads():
    c = codec(bits=8)
    for p in (-1, 2, "0", 1.0):
        with pytest.raises(CodecError, match="out of range"):
            c.decode(p, _msg())
    with pytest.raises(CodecError, match="must be bytes"):
        c.decode(0, "not bytes")
    with pytest.raises(CodecError, match="too short"):
        c.decode(0, FRAGMENT_MAGIC)
    with pytest.raises(CodecError, match="bad magic"):
        c.decode(0, b"XXXX" + _msg()[4:])
    with pytest.raises(CodecError, match="version 3: this build reads version 2"):
        c.decode(0, with_fields(_msg(), version=3))
    twins = FragmentCodec(CodecConfig(bits=8), Layout([("a",), ("b",)], {"a": (300,), "b": (300,)}))
    with pytest.raises(CodecError, match="payload is for fragment 0, not 1"):
        twins.decode(1, twins.encode({"a": np.ones(300, np.float32)}))
    with pytest.raises(CodecError, match="fragment 1: payload is 286 bytes, over the limit of 112"):
        c.decode(1, c.encode(FRAG))


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("zstd", [True, False])
@pytest.mark.parametrize("cut", [1, 4, 17])
def test_truncated_and_extended_payloads_are_refused(bits, zstd, cut):
    msg = _msg(bits, zstd)
    with pytest.raises(CodecError, match="payload_len|too short"):
        codec().decode(0, msg[:-cut])
    with pytest.raises(CodecError, match="payload_len|over the"):
        codec().decode(0, msg + bytes(cut))


@pytest.mark.parametrize("change,match", [
    (dict(bits=5), "bits"),
    (dict(flags=2), "flags"),
    (dict(reserved=1), "reserved"),
    (dict(block_size=48), "block_size"),
    (dict(block_size=8192), "block_size"),
    (dict(scale_dtype=9), "scale dtype"),
    (dict(codebook=1), "codebook"),
    (dict(fragment=7), "fragment 7"),
    (dict(raw_len=1 << 62), "raw_len"),
    (dict(raw_len=0), "raw_len"),
    (dict(payload_len=5), "payload_len"),
    (dict(payload_len=(1 << 64) - 1), "payload_len"),
    (dict(bits=4, codebook=1), "raw_len"),  # a valid header, but not the size this fragment needs
    (dict(bits=32, block_size=0, scale_dtype=0), "raw_len"),
    (dict(flags=1), "raw_len"),
])
def test_forged_header_fields_are_named(change, match):
    with pytest.raises(CodecError, match=match):
        codec().decode(0, with_fields(_msg(), **change))


def test_unquantized_headers_must_zero_the_block_fields():
    msg = _msg(bits=16)
    for change in (dict(block_size=B), dict(scale_dtype=1), dict(codebook=1)):
        with pytest.raises(CodecError, match="must be 0 for 16-bit"):
            codec().decode(0, with_fields(msg, **change))


def test_payloads_over_the_fragment_size_are_refused_before_reading():
    c = codec(bits=32, zstd=False)
    data = c.encode(OTHER)
    assert c.max_bytes(1) == len(data) == HEADER_BYTES + 4 * 20  # fp32 size + header
    with pytest.raises(CodecError, match="over the limit of 112"):
        c.decode(1, data + b"\0")
    with pytest.raises(CodecError, match="over the"):
        c.decode(1, bytes(1 << 20))
    # Tiny tensors padded to whole 8-bit blocks outgrow their fp32 size:
    # the bound is then the codec's own format's size.
    big = FragmentCodec(CodecConfig(bits=8, block_size=4096, zstd=False), LAYOUT)
    data = big.encode(FRAG)
    assert len(data) == big.max_bytes(0) > c.max_bytes(0) == HEADER_BYTES + LAYOUT.nbytes[0]
    assert set(big.decode(0, data)) == set(FRAG)
    with pytest.raises(CodecError, match="over the"):
        c.decode(0, data)
    # Smaller formats decode whatever the codec's own is.
    assert set(c.decode(0, codec(bits=4, zstd=False).encode(FRAG))) == set(FRAG)
    with pytest.raises(ValueError, match="out of range"):
        c.max_bytes(2)


def test_forged_zstd_payloads():
    import struct
    import zstandard
    msg = _msg(zstd=True)
    h = fields(msg)
    assert h["flags"] == 1
    with pytest.raises(CodecError, match="zstd chunk table.*extra bytes"):
        codec().decode(0, with_body(msg, body(msg) + b"\0"))
    with pytest.raises(CodecError, match="zstd chunk 0: stored length 0"):
        codec().decode(0, with_body(msg, bytes(len(body(msg)))))
    with pytest.raises(CodecError, match="zstd chunk table.*truncated"):
        codec().decode(0, with_body(msg, body(msg)[:-3]))
    # A well-formed frame with the wrong content size for the chunk.
    other = zstandard.ZstdCompressor().compress(bytes(h["raw_len"] - 1))
    with pytest.raises(CodecError, match="zstd chunk 0: frame declares"):
        codec().decode(0, with_body(msg, struct.pack("<I", len(other)) + other))
    # The right frame with bytes after it inside its chunk (the table counts them).
    frame0 = body(msg)[4:]
    padded = frame0 + b"\0\0"
    with pytest.raises(CodecError, match="zstd chunk 0: .* stored, its frame is"):
        codec().decode(0, with_body(msg, struct.pack("<I", len(padded)) + padded))
    # A corrupt block inside a frame of the right length.
    broken = frame0[:-4] + bytes(4)
    with pytest.raises(CodecError, match="zstd chunk 0"):
        codec().decode(0, with_body(msg, struct.pack("<I", len(broken)) + broken))


def test_highly_compressible_payloads_decode():
    lay = Layout([("z",)], {"z": (1 << 16,)})
    c = FragmentCodec(CodecConfig(bits=8), lay)
    msg = c.encode({"z": np.zeros(1 << 16, np.float32)})
    h = fields(msg)
    assert h["raw_len"] > 64 * h["payload_len"]
    np.testing.assert_array_equal(c.decode(0, msg)["z"], 0)
    with pytest.raises(CodecError, match="extra bytes"):
        c.decode(0, with_body(msg, body(msg) + b"\0"))
    with pytest.raises(CodecError, match="zstd"):
        c.decode(0, with_body(msg, body(msg)[:-1]))


def test_forged_scales_and_values_are_refused():
    msg = _msg(bits=8, zstd=False)
    n_blocks = sum(-(-np.size(x) // B) for x in FRAG.values())
    for hi, lo in [(0x7F, 0xC0), (0x00, 0x01), (0x80, 0x00), (0x7F, 0x7F)]:  # NaN, subnormal, negative, too big
        forged = patched(patched(msg, HEADER_BYTES, bytes([hi])), HEADER_BYTES + n_blocks, bytes([lo]))
        with pytest.raises(CodecError, match="scale of block 0"):
            codec().decode(0, forged)
    for bits, nan in [(16, b"\x80\x7f"), (32, b"\x00\x00\xc0\x7f")]:
        with pytest.raises(CodecError, match="tensor 0 of the fragment holds NaN/Inf"):
            codec().decode(0, patched(_msg(bits), HEADER_BYTES, nan))


def test_a_refused_payload_changes_nothing():
    c = codec(bits=4, zstd=True)
    good = c.encode(FRAG)
    before = c.decode(0, good)
    for bad in (good[:-1], with_fields(good, bits=9), b"", good + b"x"):
        with pytest.raises(CodecError):
            c.decode(0, bad)
    after = c.decode(0, good)
    assert all(before[k].tobytes() == after[k].tobytes() for k in FRAG)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_decode_gives_the_same_bits_on_any_threads_and_each_tensors_sum_of_squares(bits):
    from wan_diloco.merge import CHUNK, Workers
    big = {"w": RNG.standard_normal(2 * CHUNK + 77).astype(np.float32), "b": RNG.standard_normal(5).astype(np.float32)}
    layout = Layout([tuple(big)], {n: a.shape for n, a in big.items()})
    payload = FragmentCodec(CodecConfig(bits=bits, block_size=256, impl="jnp"), layout).encode(big)
    outs = [FragmentCodec(CodecConfig(bits=bits, block_size=256, impl="jnp"), layout, Workers(n)).decode(0, payload)
            for n in (1, 2, 4)]
    for out in outs:
        np.testing.assert_array_equal(out.sum_squares, outs[0].sum_squares)
        for n in big:
            np.testing.assert_array_equal(out[n].view(np.uint32), outs[0][n].view(np.uint32))
    want = [float(np.sum(outs[0][n].astype(np.float64) ** 2)) for n in big]
    np.testing.assert_allclose(outs[0].sum_squares, want, rtol=1e-5)


def test_block_padding_codes_do_not_count_in_the_sum_of_squares():
    c = codec(bits=8, zstd=False)
    layout_sizes = [int(np.prod(np.shape(v))) for v in FRAG.values()]
    payload = bytearray(c.encode(FRAG))
    honest = c.decode(0, bytes(payload)).sum_squares
    # The last code byte of the fragment is padding ("huge" has 40 values in two 32-value blocks).
    assert sum(-(-n // B) * B for n in layout_sizes) > sum(layout_sizes)
    payload[-1] = 100
    forged = c.decode(0, bytes(payload))
    np.testing.assert_array_equal(forged.sum_squares, honest)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_roundtrip_in_place_gives_the_same_payload_and_bits_over_the_callers_arrays(bits):
    c = codec(bits=bits)
    want = c.roundtrip(FRAG)
    mine = {n: np.array(v, np.float32) for n, v in FRAG.items()}
    got = c.roundtrip(mine, in_place=True)
    assert got.payload == want.payload
    for n in FRAG:
        np.testing.assert_array_equal(got.values[n].view(np.uint32), want.values[n].view(np.uint32))
    np.testing.assert_array_equal(got.values.sum_squares, want.values.sum_squares)
    if bits in (8, 4):  # quantized: decoded over the caller's arrays, which it said it no longer needs
        assert all(np.shares_memory(got.values[n], mine[n]) for n in FRAG if mine[n].size)
    read_only = {n: np.array(v, np.float32) for n, v in FRAG.items()}
    for a in read_only.values():
        a.flags.writeable = False  # not writable: decoded into fresh arrays instead, nothing written
    got = c.roundtrip(read_only, in_place=True)
    assert got.payload == want.payload and all(np.array_equal(read_only[n], FRAG[n]) for n in FRAG)


@pytest.mark.parametrize("bits,scale_dtype,codebook", [(32, "bfloat16", "nf4"), (16, "bfloat16", "nf4"),
                                                       (8, "float16", "nf4"), (4, "bfloat16", "nf4"),
                                                       (4, "float16", "uniform")])
def test_roundtrip_delta_fuses_delta_feedback_and_encode_with_the_bits_of_the_steps_one_by_one(bits, scale_dtype,
                                                                                              codebook):
    from wan_diloco.merge import CHUNK, Workers
    rng = np.random.default_rng(bits)
    shapes = {"w": (2 * CHUNK + 77,), "b": (5, 3), "z": (64,)}
    layout = Layout([tuple(shapes)], shapes)
    base = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    theta = {n: (b + rng.standard_normal(b.shape) * 1e-3).astype(np.float32) for n, b in base.items()}
    theta["z"] = base["z"].copy()  # Δ = 0: a zero block
    res = {n: (rng.standard_normal(s) * 1e-5).astype(np.float32) for n, s in shapes.items()}
    cfg = CodecConfig(bits=bits, block_size=256, impl="jnp", scale_dtype=scale_dtype, int4_codebook=codebook)
    # What the learner did before: Δ, + residual, encode, decode, Δ − decoded, each a whole array.
    delta = {n: (base[n] - theta[n]) + res[n] for n in shapes}
    payload = FragmentCodec(cfg, layout).encode(delta)
    decoded = FragmentCodec(cfg, layout).decode(0, payload)
    for workers in (Workers(1), Workers(2)):
        c = FragmentCodec(cfg, layout, workers)
        enc, got = c.roundtrip_delta(base, theta, res, residual=True)
        assert enc.payload == payload and enc.nbytes == len(payload)
        if c.streams:  # 8/4 bits on the host: a learner's values are decoded from the payload if looked up
            assert isinstance(enc.values, LazyValues) and not enc.values.made
        else:
            np.testing.assert_array_equal(enc.values.sum_squares, decoded.sum_squares)
        for n in shapes:
            assert enc.values[n].shape == shapes[n] == got[n].shape and not enc.values[n].flags.writeable
            assert enc.values[n].tobytes() == decoded[n].tobytes(), n
            assert got[n].tobytes() == (delta[n] - decoded[n]).tobytes(), n
        whole = c.roundtrip(delta)  # numpy values: the same one-pass encode and decode (the syncer's update)
        assert whole.payload == payload and [whole.values[n].tobytes() for n in shapes] == \
            [decoded[n].tobytes() for n in shapes]
        np.testing.assert_array_equal(whole.values.sum_squares, decoded.sum_squares)
        enc, none = c.roundtrip_delta(base, theta)  # no residual in or out
        assert none is None and enc.payload == FragmentCodec(cfg, layout).encode(
            {n: base[n] - theta[n] for n in shapes})


def test_roundtrip_delta_refuses_a_bad_residual_or_theta_naming_it():
    shapes = {"w": (300,), "b": (5,)}
    layout = Layout([tuple(shapes)], shapes)
    base = {n: np.ones(s, np.float32) for n, s in shapes.items()}
    c = FragmentCodec(CodecConfig(bits=4, block_size=64, impl="jnp"), layout)
    with pytest.raises(EncodeError, match="'b'"):
        c.roundtrip_delta(base, base, {"w": np.zeros(300, np.float32), "b": np.zeros(4, np.float32)}, True)
    with pytest.raises(EncodeError, match="exactly its tensors"):
        c.roundtrip_delta(base, base, {"w": np.zeros(300, np.float32)}, True)
    with pytest.raises(NonFiniteError, match="'w'"):
        c.roundtrip_delta(base, {"w": np.full(300, np.nan, np.float32), "b": np.ones(5, np.float32)})


def test_a_learners_fused_encode_holds_its_residual_and_payload_not_its_decoded_values():
    # What the learner sends is the payload; it keeps the residual. Decoded values would be a third fragment.
    import tracemalloc
    n = 1 << 22
    layout = Layout([("w",)], {"w": (n,)})
    c = FragmentCodec(CodecConfig(bits=4, impl="jnp"), layout)
    rng = np.random.default_rng(0)
    base, theta = {"w": rng.standard_normal(n).astype(np.float32)}, {"w": rng.standard_normal(n).astype(np.float32)}
    res = {"w": np.zeros(n, np.float32)}
    c.roundtrip_delta(base, theta, res, residual=True)  # warm: per-thread scratch
    tracemalloc.start()
    try:
        enc, got = c.roundtrip_delta(base, theta, res, residual=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.25 * 4 * n, peak / (4 * n)  # the residual (1) and the payload (0.13), in fragments
    assert enc.values["w"].tobytes() == c.decode(0, enc.payload)["w"].tobytes()
