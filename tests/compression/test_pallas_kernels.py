"""Pallas kernels (interpret mode on CPU) are bit-exact to the jax.numpy reference."""
import jax
import numpy as np
import pytest

from wan_diloco.compression import (
    HEADER_BYTES, CodecConfig, FragmentCodec, dequantize, dequantize_pallas, quantize, quantize_pallas,
)
from wan_diloco.compression.blocks import dequantize_host
from wan_diloco.fragments import Layout

B = 32


def _data(size, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size).astype(np.float32)
    x[: min(size, B)] *= 1e-33  # one block near the scale floor
    return x


@pytest.mark.parametrize("bits,codebook,stochastic,scale_dtype", [
    (8, "nf4", False, "bfloat16"), (8, "nf4", True, "float16"),
    (4, "nf4", False, "float16"), (4, "nf4", True, "bfloat16"),
    (4, "uniform", False, "bfloat16"), (4, "uniform", True, "float16"),
])
def test_quantize_and_dequantize_bit_exact(bits, codebook, stochastic, scale_dtype):
    # 7 blocks + 5 values with 2 blocks per grid step: several steps, a padded last tile.
    x = _data(7 * B + 5)
    key = jax.random.key(3) if stochastic else None
    kw = dict(bits=bits, block_size=B, scale_dtype=scale_dtype, codebook=codebook)
    c_ref, s_ref = quantize(x, key, **kw)
    c_pl, s_pl = quantize_pallas(x, key, tile_rows=2, **kw)
    assert c_pl.dtype == c_ref.dtype and c_pl.shape == c_ref.shape
    np.testing.assert_array_equal(np.asarray(c_pl), np.asarray(c_ref))
    np.testing.assert_array_equal(np.asarray(s_pl).view(np.uint32), np.asarray(s_ref).view(np.uint32))
    d_ref = dequantize(c_ref, s_ref, shape=x.shape, bits=bits, codebook=codebook)
    d_pl = dequantize_pallas(c_ref, s_ref, shape=x.shape, bits=bits, codebook=codebook, tile_rows=3)
    np.testing.assert_array_equal(np.asarray(d_pl).view(np.uint32), np.asarray(d_ref).view(np.uint32))


def test_default_tiling_and_empty_input():
    x = _data(3 * B)
    c, s = quantize_pallas(x, bits=8, block_size=B)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(quantize(x, bits=8, block_size=B)[0]))
    c0, s0 = quantize_pallas(np.zeros(0, np.float32), bits=4, block_size=B)
    assert c0.shape == (0, B // 2) and s0.shape == (0,)


@pytest.mark.parametrize("bits,codebook", [(8, "nf4"), (4, "nf4"), (4, "uniform")])
def test_encode_and_decode_are_identical_across_impls(bits, codebook):
    frag = {"w": _data(5 * B + 3, seed=1).reshape(-1, 1), "big": _data(40, 2) * np.float32(1e37)}
    layout = Layout([tuple(frag)], {k: v.shape for k, v in frag.items()})
    kw = dict(bits=bits, block_size=B, int4_codebook=codebook, zstd=False)
    pallas = FragmentCodec(CodecConfig(impl="pallas", **kw), layout)
    data = pallas.encode(frag)
    assert data == FragmentCodec(CodecConfig(impl="jnp", **kw), layout).encode(frag)
    # The host decoder (numpy) against jax.numpy and Pallas on the payload's own blocks.
    fmt = pallas.cfg.format
    nb = 6 + 2
    raw = np.frombuffer(data, np.uint8, offset=HEADER_BYTES)
    bits16 = (raw[:nb].astype(np.uint16) << 8) | raw[nb:2 * nb]
    scales = (bits16.astype(np.uint32) << 16).view(np.float32)
    codes = raw[2 * nb:].reshape(nb, -1)
    host = dequantize_host(codes, scales, fmt)
    dev_codes = codes.view(np.int8) if bits == 8 else codes
    for fn in (dequantize, dequantize_pallas):
        out = np.asarray(fn(dev_codes, scales, shape=host.shape, bits=bits, codebook=codebook))
        np.testing.assert_array_equal(out.view(np.uint32), host.view(np.uint32))
    decoded = pallas.decode(0, data)
    np.testing.assert_array_equal(decoded["w"].ravel().view(np.uint32), host.ravel()[:5 * B + 3].view(np.uint32))
