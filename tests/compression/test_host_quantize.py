"""The numpy quantizer gives jax.numpy's codes and scales bit for bit, on any number of threads."""
import numpy as np
import pytest

from wan_diloco.compression.config import Format
from wan_diloco.compression.host_quantize import quantize_host
from wan_diloco.compression.quantize import quantize
from wan_diloco.merge import CHUNK, Workers

FORMATS = [Format(4, 256, "bfloat16", "nf4"), Format(4, 64, "float16", "uniform"), Format(8, 256, "bfloat16"),
           Format(8, 32, "float16")]


def _arrays(rng):
    return [(rng.standard_normal(CHUNK + 300) * 1e-3).astype(np.float32),  # chunks and a padded tail
            np.zeros(100, np.float32), np.float32([0.5, -0.25, 3.0]),
            (rng.standard_normal(513) * 1e30).astype(np.float32),  # big scales
            (rng.standard_normal(70) * 1e-38).astype(np.float32),  # below the smallest scale
            np.float32([1.0, 1.0, -1.0, 0.5] * 16)]  # values on the levels and midpoints


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_quantizer_matches_jax_bit_for_bit_on_any_threads(fmt):
    arrays = _arrays(np.random.default_rng(fmt.bits + fmt.block_size))
    sizes = [a.size for a in arrays]
    got = [quantize_host(arrays, sizes, fmt, Workers(n)) for n in (1, 2, 4)]
    for t, a in enumerate(arrays):
        codes, scales = (np.asarray(x) for x in quantize(a, bits=fmt.bits, block_size=fmt.block_size,
                                                          scale_dtype=fmt.scale_dtype, codebook=fmt.codebook or "nf4"))
        for g in got:
            np.testing.assert_array_equal(g[t][1].view(np.uint32), scales.view(np.uint32))
            np.testing.assert_array_equal(g[t][0].view(np.uint8), codes.view(np.uint8))


def test_non_finite_values_give_a_nan_scale_as_jax_does():
    a = np.float32([1.0, np.nan] + [0.0] * 62 + [np.inf] + [0.0] * 63)
    codes, scales = quantize_host([a], [a.size], Format(4, 64, "bfloat16", "nf4"), Workers(1))[0]
    assert np.isnan(scales).all()
    want = np.asarray(quantize(a, bits=4, block_size=64, scale_dtype="bfloat16", codebook="nf4")[0])
    np.testing.assert_array_equal(codes, want.view(np.uint8))  # the codes of refused blocks too
