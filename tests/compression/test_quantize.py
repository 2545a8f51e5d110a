"""jax.numpy reference quantizers: error bounds, scales, padding, packing, rounding."""
import jax
import numpy as np
import pytest

from wan_diloco.compression import CODEBOOKS, dequantize, quantize
from wan_diloco.compression.config import INT8_QMAX, MIN_SCALE

B = 64


def _roundtrip(x, bits, codebook="nf4", key=None, scale_dtype="bfloat16"):
    codes, scales = quantize(x, key, bits=bits, block_size=B, scale_dtype=scale_dtype,
                             codebook=codebook)
    out = dequantize(codes, scales, shape=np.shape(x), bits=bits, codebook=codebook)
    return np.asarray(codes), np.asarray(scales), np.asarray(out)


def _block_scales_per_value(scales, size):
    return np.repeat(scales, B)[:size]


def _max_half_gap(codebook):
    lv = np.sort(np.unique(CODEBOOKS[codebook])) * 4  # 4-bit levels span [-4, 4]
    return float(np.max(np.diff(lv))) / 2


@pytest.mark.parametrize("size", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("bits,codebook", [(8, "nf4"), (4, "nf4"), (4, "uniform")])
def test_error_within_half_a_step_for_odd_sizes(size, bits, codebook):
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    _, scales, out = _roundtrip(x, bits, codebook)
    assert out.shape == x.shape and out.dtype == np.float32
    s = _block_scales_per_value(scales, size)
    step = 0.5 if bits == 8 else _max_half_gap(codebook)
    assert np.all(np.abs(out - x) <= step * s * (1 + 1e-6))
    rel = np.linalg.norm(out - x) / np.linalg.norm(x)
    assert rel < (0.01 if bits == 8 else 0.13)


def test_shapes_survive_padding():
    x = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7) - 50
    codes, scales, out = _roundtrip(x, 8)
    assert out.shape == (3, 5, 7)
    assert codes.shape == (2, B) and scales.shape == (2,)
    # Padding is zero, so it costs codes of 0, never shifts real values.
    assert np.all(codes.reshape(-1)[x.size:] == 0)
    assert np.abs(out - x).max() <= scales.max() / 2 * 1.000001


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_are_exact(bits):
    x = np.zeros((3, 50), np.float32)
    codes, scales, out = _roundtrip(x, bits)
    assert np.all(scales == 0) and np.array_equal(out, x)


@pytest.mark.parametrize("magnitude", [3e38, 1e30, 1e-30, 1e-35])
@pytest.mark.parametrize("bits", [8, 4])
def test_huge_and_tiny_magnitudes_keep_relative_precision(magnitude, bits):
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, 300) * magnitude).astype(np.float32)
    _, scales, out = _roundtrip(x, bits)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(scales))
    xd = x.astype(np.float64)
    rel = np.linalg.norm(out - xd) / np.linalg.norm(xd)
    assert rel < (0.01 if bits == 8 else 0.13)


def test_scales_are_rounded_up_bf16_values_with_a_floor():
    x = np.random.default_rng(2).standard_normal(10 * B).astype(np.float32)
    x[:B] *= 1e-36  # tiny block: the scale floor applies
    x[B:2 * B] *= 1e-39  # subnormal block: XLA on CPU flushes it to zero
    codes, scales, out = _roundtrip(x, 8)
    absmax = np.abs(x.reshape(-1, B)).max(1)
    assert np.all(scales.view(np.uint32) & 0xFFFF == 0), "not bf16 values"
    assert scales[0] == MIN_SCALE
    assert scales[1] in (0.0, MIN_SCALE)
    assert np.all(scales[2:] >= absmax[2:] / INT8_QMAX)
    assert np.all(scales[2:] <= absmax[2:] / INT8_QMAX * (1 + 2**-7))
    nonzero = out[out != 0]
    assert np.all(np.abs(nonzero) >= 2.0**-126), "decoded a subnormal"
    assert codes.min() >= -INT8_QMAX and codes.max() <= INT8_QMAX


def test_float16_scales_round_up_and_overflow_to_inf():
    x = np.random.default_rng(3).standard_normal(2 * B).astype(np.float32)
    x[B:] *= 1e8  # absmax / 127 > 65504: no float16 scale fits
    _, scales, _ = _roundtrip(x, 8, scale_dtype="float16")
    assert scales[0] == np.float16(scales[0]) and scales[0] >= np.abs(x[:B]).max() / 127
    assert np.isposinf(scales[1])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_input_gives_nan_scale(bad, bits):
    x = np.ones(3 * B, np.float32)
    x[B + 5] = bad
    _, scales, _ = _roundtrip(x, bits)
    assert np.isfinite(scales[0]) and np.isnan(scales[1]) and np.isfinite(scales[2])


def test_int4_packing_layout():
    # Block of 64 values, all levels of the uniform codebook at known positions.
    lv = CODEBOOKS["uniform"][:15]
    x = np.zeros(B, np.float32)
    x[0], x[1], x[B // 2], x[B // 2 + 1] = lv[0], lv[14], lv[3], lv[9]
    codes, scales, out = _roundtrip(x, 4, "uniform")
    assert scales[0] == 0.25  # absmax / 4
    assert codes[0, 0] == 0 | (3 << 4)
    assert codes[0, 1] == 14 | (9 << 4)
    assert codes[0, 2] == 7 | (7 << 4)  # zeros map to the zero level, index 7
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    rng = np.random.default_rng(4)
    x = rng.standard_normal(B).astype(np.float32)
    x[0] = 4.0  # fixes the scale; the rest fall between levels
    outs = np.stack([_roundtrip(x, bits, key=jax.random.key(i))[2] for i in range(200)])
    nearest = _roundtrip(x, bits)[2]
    bias_sr = np.abs(outs.mean(0) - x).mean()
    bias_rtn = np.abs(nearest - x).mean()
    assert bias_sr < 0.35 * bias_rtn
    assert not np.array_equal(outs[0], outs[1])
