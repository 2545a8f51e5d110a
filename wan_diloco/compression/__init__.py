"""Outer-gradient compression: the one fragment codec (:class:`FragmentCodec`) for
fp32, bf16, blockwise int8 and 4-bit (NF4 / uniform), built from small stages:
quantize (``quantize`` jax.numpy, ``pallas_kernels`` Pallas, ``blocks``) ->
pack (``pack``) -> entropy (``entropy``, zstd) -> frame (``frame``, fixed header)."""
from wan_diloco.compression.config import CODEBOOKS, NF4_LEVELS, CodecConfig, Format
from wan_diloco.compression.errors import CodecError, EncodeError, NonFiniteError
from wan_diloco.compression.fragment import FragmentCodec
from wan_diloco.compression.frame import FRAGMENT_MAGIC, HEADER_BYTES
from wan_diloco.compression.pallas_kernels import dequantize_pallas, quantize_pallas
from wan_diloco.compression.quantize import dequantize, quantize

__all__ = [
    "CODEBOOKS", "CodecConfig", "CodecError", "EncodeError", "FRAGMENT_MAGIC", "Format",
    "FragmentCodec", "HEADER_BYTES", "NF4_LEVELS", "NonFiniteError", "dequantize",
    "dequantize_pallas", "quantize", "quantize_pallas",
]
