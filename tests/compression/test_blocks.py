"""The host dequantizer (``blocks.dequantize_into``) against jax.numpy's, bit for bit, over every code byte."""
import numpy as np
import pytest

from wan_diloco.compression import dequantize
from wan_diloco.compression.blocks import dequantize_host, dequantize_into
from wan_diloco.compression.config import CodecConfig
from wan_diloco.merge import CHUNK


@pytest.mark.parametrize("codebook,block_size", [("nf4", 256), ("uniform", 64)])
def test_every_code_byte_over_several_chunks_matches_jax(codebook, block_size):
    rng = np.random.default_rng(3)
    rows = 2 * (CHUNK // block_size) + 5  # three chunks, the last one short
    codes = rng.integers(0, 256, (rows, block_size // 2), dtype=np.uint8)
    codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every code byte, in the first blocks
    scales = rng.uniform(1e-6, 1e3, rows).astype(np.float32)
    scales[4] = 0.0
    fmt = CodecConfig(bits=4, block_size=block_size, int4_codebook=codebook).format
    want = np.asarray(dequantize(codes, scales, shape=(rows, block_size), bits=4, codebook=codebook))
    got = dequantize_host(codes, scales, fmt)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    out = np.full((rows, block_size), np.nan, np.float32)  # into a caller's buffer: every value written
    dequantize_into(codes, scales, fmt, out)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
