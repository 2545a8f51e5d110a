"""Format 2's zstd chunks: where they fall, payloads of many chunks, the values of format 1, and the memory
a decode holds."""
import tracemalloc

import numpy as np
import pytest
import zstandard

from .codec_forge import HEADER, body, fields
from wan_diloco.compression import CodecConfig, CodecError, Format, FragmentCodec, blocks, chunks, pack
from wan_diloco.compression.quantize import n_blocks
from wan_diloco.fragments import Layout
from wan_diloco.merge import CHUNK, Workers

RNG = np.random.default_rng(3)
# "w" spans several chunks in every format; "v" starts inside one and ends in the next.
SHAPES = {"w": (3 * (1 << 20) + 77,), "b": (5, 3), "e": (0,), "v": (1 << 20,), "z": (300,)}
VALUES = {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
VALUES["z"][:] = 0
LAYOUT = Layout([tuple(SHAPES)], SHAPES)
SIZES = [int(np.prod(s)) for s in SHAPES.values()]
FORMATS = [(32, "bfloat16", "nf4"), (16, "bfloat16", "nf4"), (8, "float16", "nf4"), (8, "bfloat16", "nf4"),
           (4, "bfloat16", "nf4"), (4, "float16", "uniform")]


def codec(bits, scale_dtype="bfloat16", codebook="nf4", workers=1, **kw) -> FragmentCodec:
    cfg = CodecConfig(bits=bits, block_size=64, scale_dtype=scale_dtype, int4_codebook=codebook, impl="jnp", **kw)
    return FragmentCodec(cfg, LAYOUT, Workers(workers))


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_chunks_cover_the_raw_bytes_and_items_never_cross_a_chunk(bits):
    fmt = codec(bits).cfg.format
    spans = chunks.spans(fmt, SIZES)
    assert len(spans) > 1 and spans[0][0] == 0
    assert all(a + la == b for (a, la), (b, _) in zip(spans, spans[1:]))
    assert sum(ln for _, ln in spans) == pack.raw_nbytes(fmt, SIZES)
    if not fmt.quantized:
        assert {ln for _, ln in spans[:-1]} == {chunks.ZCHUNK_BYTES}
        return
    m = chunks.chunk_blocks(fmt)
    starts = np.cumsum([0] + [n_blocks(n, 64) for n in SIZES])
    seen = []
    for t, a, b, c in chunks.block_items(SIZES, fmt):
        assert 0 < (b - a) * 64 <= CHUNK and c * m <= starts[t] + a < starts[t] + b <= (c + 1) * m
        seen += range(starts[t] + a, starts[t] + b)
    assert seen == list(range(starts[-1]))  # every block once, in order
    assert any(b - a < CHUNK // 64 and b < n_blocks(SIZES[t], 64) for t, a, b, _ in chunks.block_items(SIZES, fmt))


@pytest.mark.parametrize("bits,scale_dtype,codebook", FORMATS)
def test_many_chunks_decode_as_the_sender_and_the_same_on_1_and_3_threads(bits, scale_dtype, codebook):
    for zstd in (True, False):
        enc = codec(bits, scale_dtype, codebook, zstd=zstd).roundtrip(VALUES)
        n_chunks = len(chunks.spans(codec(bits).cfg.format, SIZES))
        h = fields(enc.payload)
        assert h["flags"] == zstd and h["payload_len"] == len(enc.payload) - HEADER.size
        if zstd:
            table = np.frombuffer(body(enc.payload), "<u4", n_chunks)
            assert 4 * n_chunks + int(table.sum()) == h["payload_len"] < h["raw_len"]
        outs = [codec(bits, scale_dtype, codebook, w, zstd=zstd).decode(0, enc.payload) for w in (1, 3)]
        for out in outs:
            np.testing.assert_array_equal(out.sum_squares, enc.values.sum_squares)
            for n in SHAPES:
                assert out[n].shape == SHAPES[n] and out[n].tobytes() == enc.values[n].tobytes(), n


def _format1_raw(fmt: Format, arrays) -> tuple[bytes, list[np.ndarray]]:
    """Format 1's raw bytes of ``arrays`` (all scales in front for 8/4 bits) and the values its decoder
    gave: main's quantizer and the host dequantizer, without the chunked code."""
    if fmt.bits == 32:
        return b"".join(a.tobytes() for a in arrays), [a.reshape(-1) for a in arrays]
    if fmt.bits == 16:
        u16 = [np.asarray(pack._bf16_bits(a)).reshape(-1) for a in arrays]
        return b"".join(u.tobytes() for u in u16), [(u.astype(np.uint32) << 16).view(np.float32) for u in u16]
    per = blocks.quantize_fragment(arrays, [a.size for a in arrays], fmt, "jnp")
    scales = np.concatenate([s for _, s in per])
    sb = (scales.view(np.uint32) >> 16).astype(np.uint16) if fmt.scale_dtype == "bfloat16" \
        else scales.astype(np.float16).view(np.uint16)
    raw = (sb >> 8).astype(np.uint8).tobytes() + (sb & 0xFF).astype(np.uint8).tobytes() + \
        b"".join(c.tobytes() for c, _ in per)
    stored = pack.read_scales(sb, fmt)  # what the decoder read back from the bits
    values, first = [], 0
    for a, (codes, _) in zip(arrays, per):
        k = codes.shape[0]
        values.append(blocks.dequantize_host(codes, stored[first:first + k], fmt).reshape(-1)[:a.size])
        first += k
    return raw, values


@pytest.mark.parametrize("bits,scale_dtype,codebook", FORMATS)
def test_values_are_format_1s_and_a_format_1_payload_is_refused_naming_both_versions(bits, scale_dtype, codebook):
    c = codec(bits, scale_dtype, codebook)
    arrays = [VALUES[n] for n in SHAPES]
    raw, want = _format1_raw(c.cfg.format, arrays)
    assert len(raw) == pack.raw_nbytes(c.cfg.format, SIZES)
    got = c.decode(0, c.encode(VALUES))
    for n, w in zip(SHAPES, want):
        assert got[n].reshape(-1).tobytes() == w.tobytes(), n
    old = zstandard.ZstdCompressor(level=1).compress(raw)
    f = fields(c.encode(VALUES))
    f.update(version=1, raw_len=len(raw), payload_len=len(old))
    v1 = HEADER.pack(*f.values()) + old
    with pytest.raises(CodecError, match="fragment format version 1: this build reads version 2"):
        c.decode(0, v1)


@pytest.mark.parametrize("bits", [32, 4])
def test_a_chunk_stored_raw_among_zstd_chunks_decodes(bits):
    c = codec(bits)
    data = c.encode(VALUES)
    spans = chunks.spans(c.cfg.format, SIZES)
    n = len(spans)
    table = np.frombuffer(body(data), "<u4", n).copy()
    frames = bytes(body(data)[4 * n:])
    raw0 = np.frombuffer(zstandard.ZstdDecompressor().decompress(frames[:table[0]]), np.uint8)
    assert raw0.size == spans[0][1]
    # Chunk 0 as an encoder stores a chunk zstd cannot shrink: its raw bytes, stored length = raw length.
    forged_table = np.concatenate([[spans[0][1]], table[1:]]).astype("<u4")
    new_body = forged_table.tobytes() + raw0.tobytes() + frames[table[0]:]
    f = fields(data)
    f.update(payload_len=len(new_body))
    out = c.decode(0, HEADER.pack(*f.values()) + new_body)
    want = c.decode(0, data)
    assert all(out[k].tobytes() == want[k].tobytes() for k in SHAPES)


def test_a_decode_never_holds_the_whole_decompressed_payload():
    n = 8 << 20  # int8: 8 chunks of 1 MiB of codes
    shapes = {"w": (n,)}
    c = FragmentCodec(CodecConfig(bits=8, block_size=256), Layout([("w",)], shapes))
    data = bytes(c.encode({"w": RNG.standard_normal(n).astype(np.float32)}))
    raw_len = fields(data)["raw_len"]
    c.decode(0, data)  # this thread's scratch, once
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = c.decode(0, data)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # The decoded values (pooled, maybe reused: at most 4n bytes) and less than a quarter of the raw bytes.
    assert out["w"].size == n and peak < 4 * n + raw_len // 4, (peak, raw_len)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_refused_in_place_roundtrip_leaves_the_callers_arrays_as_they_were(bits):
    mine = {n: v.copy() for n, v in VALUES.items()}
    mine["v"][-1] = np.nan  # in the last chunk: the chunks before it are quantized first
    before = {n: v.copy() for n, v in mine.items()}
    with pytest.raises(CodecError, match="'v'.*NaN/Inf"):
        codec(bits, workers=3).roundtrip(mine, in_place=True)
    assert all(mine[n].tobytes() == before[n].tobytes() for n in SHAPES)
