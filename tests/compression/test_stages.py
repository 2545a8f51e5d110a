"""The codec's stages on their own: frame header, entropy, pack, the fragment quantizer."""
import numpy as np
import pytest
import zstandard

from wan_diloco.compression import CodecConfig, CodecError, Format, quantize
from wan_diloco.compression import blocks, chunks, entropy, frame, pack
from wan_diloco.merge import SERIAL

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
def _source(data: bytes, spans):
    return lambda c, out: np.frombuffer(data, np.uint8, spans[c][1], spans[c][0])


def _compress(data: bytes, spans):
    out = bytearray(4 * len(spans) + len(data))
    end = entropy.compress_chunks(_source(data, spans), spans, 1, SERIAL, out, 0)
    return None if end is None else memoryview(bytes(out[:end]))


def test_entropy_keeps_zstd_per_chunk_only_when_smaller():
    noise = np.random.default_rng(0).bytes(4096)
    data = bytes(4096) + noise + bytes(1000)
    spans = [(0, 4096), (4096, 4096), (8192, 1000)]
    body = _compress(data, spans)
    lengths = np.frombuffer(body, "<u4", 3)
    assert lengths[1] == 4096 and lengths[0] < 100 and lengths[2] < 100  # the noise chunk is stored raw
    assert len(body) == 12 + lengths.sum() < len(data)
    assert zstandard.frame_content_size(body[12:12 + int(lengths[0])]) == 4096
    got = entropy.Chunks(body, spans)
    assert b"".join(bytes(got.read(c, np.empty(ln, np.uint8))) for c, (_, ln) in enumerate(spans)) == data
    assert _compress(noise, [(0, 4096)]) is None  # no smaller: the payload is stored raw, without a table


def test_entropy_gives_the_raw_bytes_back_when_the_table_eats_the_gain():
    rng = np.random.default_rng(1)
    data = bytes(24) + rng.bytes(4096) + rng.bytes(4096)
    spans = [(0, 24), (24, 4096), (4120, 4096)]
    assert len(zstandard.ZstdCompressor(level=1).compress(bytes(24))) < 24 - 4  # chunk 0 alone would shrink
    out = bytearray(12 + len(data))
    assert entropy.compress_chunks(_source(data, spans), spans, 1, SERIAL, out, 0) is None
    assert bytes(out[12:]) == data  # chunk 0 decompressed back in place


def test_entropy_refuses_frames_that_disagree_with_the_table():
    spans = [(0, 16384)]
    frame16k = zstandard.ZstdCompressor(level=1).compress(bytes(range(256)) * 64)

    def read(frame_bytes, raw=16384):
        body = memoryview(np.array([len(frame_bytes)], "<u4").tobytes() + frame_bytes)
        return entropy.Chunks(body, [(0, raw)]).read(0, np.empty(raw, np.uint8))

    assert bytes(read(frame16k)) == bytes(range(256)) * 64
    with pytest.raises(CodecError, match="zstd chunk 0: frame declares 16384 bytes, the chunk has 16383"):
        read(frame16k, 16383)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(range(256)) * 64)
    with pytest.raises(CodecError, match="declares"):
        read(no_size)
    with pytest.raises(CodecError, match="invalid"):
        read(b"\0" * 8)
    with pytest.raises(CodecError, match="truncated"):
        entropy.Chunks(memoryview(b"\1\0"), spans)
    with pytest.raises(CodecError, match=r"stored length 16385, not in \[1, its raw 16384"):
        entropy.Chunks(memoryview(np.array([16385], "<u4").tobytes() + bytes(16385)), spans)


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
    sizes = [a.size for a in arrays]
    packed = pack.pack(fmt, ["a", "b", "c", "d"], arrays)
    assert packed.raw_len == pack.raw_nbytes(fmt, sizes)
    raw = np.empty(packed.raw_len, np.uint8)
    chunks.copy_raw(packed.read, packed.spans, raw, SERIAL)
    out, sums = pack.unpack(fmt, pack.Whole(raw, packed.spans), sizes)
    again, _ = pack.unpack(fmt, packed, sizes)  # the sender's: from the parts, the same bits
    tol = {32: 0, 16: 2**-8, 8: 0.01, 4: 0.15}[fmt.bits]
    for a, b, c, sq in zip(arrays, out, again, sums):
        assert b.dtype == np.float32 and b.shape == a.shape and b.tobytes() == c.tobytes()
        assert np.linalg.norm(b - a) <= tol * np.linalg.norm(a)
        assert sq == pytest.approx(float(np.sum(b.astype(np.float64) ** 2)), rel=1e-6)  # the padding excluded
    if fmt.quantized:  # one chunk: its scale planes first, high bytes of all 6 blocks, then low bytes
        nb = 6
        scales = np.concatenate([np.asarray(quantize(a, bits=fmt.bits, block_size=64,
                                                     scale_dtype=fmt.scale_dtype,
                                                     codebook=fmt.codebook or "nf4")[1])
                                 for a in arrays])
        sb = (scales.view(np.uint32) >> 16).astype(np.uint16) if fmt.scale_dtype == "bfloat16" \
            else scales.astype(np.float16).view(np.uint16)
        assert raw[:nb].tobytes() == (sb >> 8).astype(np.uint8).tobytes()
        assert raw[nb:2 * nb].tobytes() == (sb & 0xFF).astype(np.uint8).tobytes()


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
