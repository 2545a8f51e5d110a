"""The codec's stages on their own: frame header, entropy, pack, the fragment quantizer."""
import numpy as np
import pytest
import zstandard

from wan_diloco.compression import CodecConfig, CodecError, Format, quantize
from wan_diloco.compression import blocks, entropy, frame, pack

F8 = Format(8, 64, "bfloat16")
F4 = Format(4, 64, "float16", "uniform")


# ------------------------------------------------------------------ config
def test_config_format_drops_fields_that_do_not_apply():
    assert CodecConfig(bits=32, block_size=64).format == Format(32)
    assert CodecConfig(bits=16, int4_codebook="uniform").format == Format(16)
    assert CodecConfig(bits=8, block_size=64).format == F8
    assert CodecConfig(bits=4, block_size=64, scale_dtype="float16", int4_codebook="uniform").format == F4


# ------------------------------------------------------------------- frame
@pytest.mark.parametrize("fmt", [Format(32), Format(16), F8, F4])
@pytest.mark.parametrize("zstd", [True, False])
def test_header_roundtrip(fmt, zstd):
    h = frame.Header(fmt, zstd, fragment=2**32 - 1, raw_len=1000, payload_len=999 if zstd else 1000)
    data = frame.pack_header(h) + bytes(h.payload_len)
    assert len(data) - h.payload_len == frame.HEADER_BYTES == 32
    assert data[:4] == frame.FRAGMENT_MAGIC
    assert frame.parse_header(memoryview(data)) == h


def test_header_length_rules():
    h = frame.Header(Format(32), True, 0, raw_len=10, payload_len=10)
    with pytest.raises(CodecError, match="not more than the 10 zstd bytes"):
        frame.parse_header(memoryview(frame.pack_header(h) + bytes(10)))
    h = frame.Header(Format(32), False, 0, raw_len=10, payload_len=8)
    with pytest.raises(CodecError, match="stored uncompressed"):
        frame.parse_header(memoryview(frame.pack_header(h) + bytes(8)))
    with pytest.raises(CodecError, match="9 follow the header"):
        frame.parse_header(memoryview(frame.pack_header(h) + bytes(9)))
    with pytest.raises(CodecError, match="too short"):
        frame.parse_header(memoryview(frame.pack_header(h)[:-1]))


# ----------------------------------------------------------------- entropy
def test_entropy_keeps_zstd_only_when_smaller():
    assert entropy.compress(b"", 1) is None
    assert entropy.compress(np.random.default_rng(0).bytes(4096), 1) is None
    raw = bytes(4096)
    packed = entropy.compress(raw, 1)
    assert packed is not None and len(packed) < 100
    assert zstandard.frame_content_size(packed) == 4096  # decompress checks it against raw_len
    assert entropy.decompress(memoryview(packed), 4096) == raw


def test_entropy_refuses_frames_that_disagree_with_the_header():
    packed = entropy.compress(bytes(range(256)) * 64, 1)
    with pytest.raises(CodecError, match="declares 16384 bytes, header says 16383"):
        entropy.decompress(memoryview(packed), 16383)
    with pytest.raises(CodecError, match="zstd"):
        entropy.decompress(memoryview(packed[:-2]), 16384)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(100))
    with pytest.raises(CodecError, match="declares"):
        entropy.decompress(memoryview(no_size), 100)
    with pytest.raises(CodecError, match="invalid"):
        entropy.decompress(memoryview(b"\0" * 8), 100)


# -------------------------------------------------------------------- pack
def test_raw_sizes():
    sizes = [1, 64, 65, 0]
    assert pack.raw_nbytes(Format(32), sizes) == 4 * 130
    assert pack.raw_nbytes(Format(16), sizes) == 2 * 130
    assert pack.raw_nbytes(F8, sizes) == 4 * (2 + 64)  # 1 + 1 + 2 + 0 blocks
    assert pack.raw_nbytes(F4, sizes) == 4 * (2 + 32)
    with pytest.raises(CodecError, match="bits: 12"):
        pack.raw_nbytes(Format(12), sizes)


@pytest.mark.parametrize("fmt", [Format(32), Format(16), F8, F4])
def test_pack_unpack(fmt):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (1, 64, 200, 0)]
    parts = pack.pack(fmt, ["a", "b", "c", "d"], arrays)
    raw = b"".join(parts)
    assert len(raw) == pack.raw_nbytes(fmt, [a.size for a in arrays])
    out, sums = pack.unpack(fmt, raw, [a.size for a in arrays])
    tol = {32: 0, 16: 2**-8, 8: 0.01, 4: 0.15}[fmt.bits]
    for a, b, sq in zip(arrays, out, sums):
        assert b.dtype == np.float32 and b.shape == a.shape
        assert np.linalg.norm(b - a) <= tol * np.linalg.norm(a)
        assert sq == pytest.approx(float(np.sum(b.astype(np.float64) ** 2)), rel=1e-6)  # the padding excluded
    if fmt.quantized:  # scale planes first: high bytes of all 6 blocks, then low bytes
        nb = 6
        scales = np.concatenate([np.asarray(quantize(a, bits=fmt.bits, block_size=64,
                                                     scale_dtype=fmt.scale_dtype,
                                                     codebook=fmt.codebook or "nf4")[1])
                                 for a in arrays])
        sb = (scales.view(np.uint32) >> 16).astype(np.uint16) if fmt.scale_dtype == "bfloat16" \
            else scales.astype(np.float16).view(np.uint16)
        assert raw[:nb] == (sb >> 8).astype(np.uint8).tobytes()
        assert raw[nb:2 * nb] == (sb & 0xFF).astype(np.uint8).tobytes()


# ------------------------------------------------------------------ blocks
@pytest.mark.parametrize("fmt", [F8, F4])
def test_batching_small_tensors_changes_no_bits(fmt):
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(n).astype(np.float32) * s for n, s in
              [(5, 1e-3), (70_000, 1.0), (130, 1e3), (0, 1.0), (64, 1.0)]]
    sizes = [a.size for a in arrays]
    got = blocks.quantize_fragment(arrays, sizes, fmt, "jnp")
    for a, (codes, scales) in zip(arrays, got):
        ref_c, ref_s = quantize(a, bits=fmt.bits, block_size=fmt.block_size, scale_dtype=fmt.scale_dtype,
                                codebook=fmt.codebook or "nf4")
        np.testing.assert_array_equal(codes, np.asarray(ref_c))
        np.testing.assert_array_equal(scales.view(np.uint32), np.asarray(ref_s).view(np.uint32))


def test_resolve_impl():
    assert blocks.resolve_impl("jnp") == "jnp" and blocks.resolve_impl("pallas") == "pallas"
    assert blocks.resolve_impl("auto") in ("jnp", "pallas")
