"""An upload kept in its codes (``compression.coded``): checked and measured as ``decode`` does, and folded
into a merge straight from the codes with the bits of decoding first; what it holds meanwhile."""
import tracemalloc

import numpy as np
import pytest

from wan_diloco.compression import CodecConfig, CodecError, FragmentCodec, chunks
from wan_diloco.compression.coded import RAW, Coded
from wan_diloco.compression.fragment import Decoded
from wan_diloco.fragments import Layout
from wan_diloco.merge import Accumulator, Workers, sum_squares

RNG = np.random.default_rng(11)
# "w" spans several zstd chunks, "v" starts inside one and ends in the next, "b" and "z" pad their last block.
SHAPES = {"w": (5 * (1 << 20) + 77,), "b": (5, 3), "e": (0,), "v": (1 << 20,), "z": (300,)}
SIZES = [int(np.prod(s)) for s in SHAPES.values()]
LAYOUT = Layout([tuple(SHAPES)], SHAPES)
FORMATS = [(8, "float16", "nf4"), (8, "bfloat16", "nf4"), (4, "bfloat16", "nf4"), (4, "float16", "uniform")]


def codec(bits, scale_dtype, codebook, workers=1, **kw) -> FragmentCodec:
    cfg = CodecConfig(bits=bits, block_size=64, scale_dtype=scale_dtype, int4_codebook=codebook, impl="jnp", **kw)
    return FragmentCodec(cfg, LAYOUT, Workers(workers))


def upload(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in SHAPES.items()}


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("bits,scale_dtype,codebook", FORMATS)
@pytest.mark.parametrize("zstd", [True, False])
def test_a_deferred_decode_checks_and_measures_as_decode_and_decodes_to_its_values(bits, scale_dtype, codebook, zstd):
    payload = codec(bits, scale_dtype, codebook, zstd=zstd).encode(upload(1))
    want = codec(bits, scale_dtype, codebook).decode(0, payload)
    for workers in (1, 3):
        got = codec(bits, scale_dtype, codebook, workers, zstd=zstd).decode(0, payload, deferred=True)
        assert isinstance(got, Coded) and list(got) == list(SHAPES) and len(got) == len(SHAPES)
        assert got.shapes == SHAPES
        # Summed as the merge sums the values (not as the decoder does: chunk by chunk), to the bit.
        assert _bits(got.sum_squares) == _bits(sum_squares(list(want.values())))
        np.testing.assert_allclose(got.sum_squares, want.sum_squares, rtol=1e-6)
        for n in SHAPES:  # the first lookup decodes them all
            assert got[n].shape == SHAPES[n] and _bits(got[n]) == _bits(want[n]) and not got[n].flags.writeable
        got.clear()
        with pytest.raises(ValueError, match="cleared"):
            got["w"]


@pytest.mark.parametrize("bits", [32, 16])
def test_formats_without_codes_decode_as_without_deferred(bits):
    c = codec(bits, "bfloat16", "nf4")
    out = c.decode(0, c.encode(upload(2)), deferred=True)
    assert isinstance(out, Decoded)


@pytest.mark.parametrize("bits,scale_dtype,codebook", FORMATS)
@pytest.mark.parametrize("rda", [True, False])
def test_folding_the_codes_gives_the_bits_of_decoding_then_folding(bits, scale_dtype, codebook, rda):
    # Three uploads of different norms and weights: the first fills the sums, a larger coefficient later
    # rescales them, a gain scales one; every tensor both ways, on 1 and 3 threads.
    payloads = [codec(bits, scale_dtype, codebook).encode(upload(10 + m, 10.0 ** (m - 1))) for m in range(3)]
    weights, gains = [3.0, 0.5, 2.0], [1.0, 1.0, 0.25]
    results = []
    for workers in (1, 3):
        c = codec(bits, scale_dtype, codebook, workers)
        for deferred in (False, True):
            acc = Accumulator(list(SHAPES.values()), [rda and n != "b" for n in SHAPES], Workers(workers))
            for p, w, g in zip(payloads, weights, gains):
                d = c.decode(0, p, deferred=deferred)  # the values: the merge computes their norms
                acc.add(d if deferred else list(d.values()), w, list(d.sum_squares) if deferred else None, g)
            results.append([_bits(r) for r in acc.result()])
    assert all(r == results[0] for r in results[1:])


def test_a_coded_rda_fold_without_its_norms_takes_them_from_the_values():
    c = codec(4, "bfloat16", "nf4")
    payloads = [c.encode(upload(20 + m)) for m in range(2)]
    out = []
    for deferred in (False, True):
        acc = Accumulator(list(SHAPES.values()), [True] * len(SHAPES))
        for p in payloads:
            d = c.decode(0, p, deferred=deferred)
            acc.add(d if deferred else list(d.values()), 1.0)
        out.append([_bits(r) for r in acc.result()])
    assert out[0] == out[1]


def test_a_bad_scale_is_refused_by_the_deferred_decode_too():
    c = codec(4, "bfloat16", "nf4", zstd=False)
    data = bytearray(c.encode(upload(3)))
    from wan_diloco.compression import HEADER_BYTES
    data[HEADER_BYTES] |= 0x80  # the first block's scale: negative
    for d in (False, True):
        with pytest.raises(CodecError, match="scale of block 0"):
            c.decode(0, data, deferred=d)


def test_a_coded_upload_holds_its_raw_bytes_not_its_values():
    c = codec(4, "bfloat16", "nf4")
    payload = c.encode(upload(4))
    fp32 = sum(SIZES) * 4
    c.decode(0, payload, deferred=True).clear()  # warm: the threads' scratch
    RAW.clear()  # the raw bytes' buffer is made afresh and counted
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        got = c.decode(0, payload, deferred=True)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    raw = sum(ln for _, ln in chunks.spans(c.cfg.format, SIZES))
    assert raw * 0.99 <= held <= raw * 1.01 + (1 << 20) and raw < fp32 / 7, (held, raw, fp32)
    got.clear()
