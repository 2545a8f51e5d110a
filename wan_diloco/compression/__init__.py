"""Outer-gradient compression: blockwise int8 / 4-bit quantizers (jax.numpy and
Pallas), a safe wire codec with zstd and a checksum, and error feedback."""
from wan_diloco.compression.codec import (
    EncodeError, NonFiniteError, decode, encode, resolve_impl, roundtrip,
)
from wan_diloco.compression.config import CODEBOOKS, NF4_LEVELS, CodecConfig
from wan_diloco.compression.feedback import ErrorFeedback
from wan_diloco.compression.pallas_kernels import dequantize_pallas, quantize_pallas
from wan_diloco.compression.quantize import dequantize, quantize
from wan_diloco.compression.wire import DEFAULT_MAX_BYTES, CodecError

__all__ = [
    "CODEBOOKS", "CodecConfig", "CodecError", "DEFAULT_MAX_BYTES", "EncodeError", "ErrorFeedback",
    "NF4_LEVELS", "NonFiniteError", "decode", "dequantize", "dequantize_pallas", "encode",
    "quantize", "quantize_pallas", "resolve_impl", "roundtrip",
]
