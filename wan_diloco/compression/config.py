"""Codec configuration, the wire format it implies, and the fixed tables the header refers to.

Defaults come from ``bench/codec.py`` (figures in docs/benchmarks.md):

* ``block_size = 256``: on real outer gradients (the tiny transformer's, captured
  from the simulator) NF4 with 256-value blocks meets both int4 targets:
  9.55 % error at 8.23x smaller than fp32 after zstd; 128 gives 9.33 % at 7.97x
  (under the 8x line: the transformer has many small tensors, so scales weigh
  more), 64 gives 9.1 % at 7.73x. int8 stays inside its 1 % target (0.63 %).
  On Gaussian data 256 gives 9.88 % at 8.43x.
* ``scale_dtype = "bfloat16"``: bf16 has fp32's exponent range, so no block of
  huge or tiny values over- or underflows its scale; its short mantissa costs
  nothing because scales are rounded *up* and values are quantized against the
  stored scale. Its exponent byte is also very repetitive, so zstd shrinks
  scales to ~8 bits (fp16: ~12): int4 8.33x vs 8.23x with fp16 scales.
* ``int4_codebook = "nf4"``: at equal block size uniform int4 has more error
  (outer gradients, 256: 11.3 % vs 9.55 %); uniform int4 with 64-value blocks
  (9.67 %, 8.55x) is the other setting that meets both targets there. On
  Student-t(3) data (heavy tails) no 4-bit setting reaches 10 % at 8x.
* ``zstd_level = 1``: level 3 gains < 1 % size and costs speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from wan_diloco.config import require

# QLoRA's NormalFloat4 levels (quantiles of N(0,1) scaled to [-1, 1], exact 0).
NF4_LEVELS = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
     0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)
# Uniform int4: k/7 for k = -7..7; code 15 is never produced and decodes to 0.
UNIFORM4_LEVELS = np.append(np.arange(-7, 8, dtype=np.float32) / 7, np.float32(0))
CODEBOOKS = {"nf4": NF4_LEVELS, "uniform": UNIFORM4_LEVELS}
# Header ids (never renumber: they are part of format version 1).
CODEBOOK_IDS = {"nf4": 1, "uniform": 2}
SCALE_DTYPE_IDS = {"bfloat16": 1, "float16": 2}

# Smallest scale written. The smallest non-zero level of any codebook is above
# 2^-4, so every decoded value is 0 or a normal fp32 number (>= 2^-126) and no
# device's flush-to-zero mode can change a decoded bit.
MIN_SCALE = float(2.0**-122)
INT8_QMAX = 127
# 4-bit codebooks are used scaled to [-4, 4] (scale = absmax / 4): 4 is a power
# of two, so nothing is lost, and 1/scale stays a normal float even for absmax
# near fp32's max (with [-1, 1] it would be subnormal and flushed to zero).
INT4_QMAX = 4
BLOCK_SIZE_RANGE = (16, 4096)
# The bit widths of values on the wire, widest first: the one list (the codec, its frame header, the
# planner's options and the bandwidth model all take it from here). 8 and 4 are blockwise quantized.
BITS = (32, 16, 8, 4)
QUANTIZED_BITS = (8, 4)


@dataclass(frozen=True)
class CodecConfig:
    """How one fragment is encoded on the wire.

    bits: 32 = raw fp32, 16 = bf16 (round to nearest even), 8 = blockwise
      absmax int8, 4 = blockwise absmax 4-bit codebook, two codes per byte.
    block_size: values sharing one scale (power of two, 16..4096).
    scale_dtype: storage of the per-block scale ("bfloat16" | "float16").
    int4_codebook: "nf4" (normal-float levels) or "uniform" (k/7).
    zstd / zstd_level: entropy stage over the whole payload.
    stochastic_rounding: unbiased rounding (needs a PRNG key at encode time).
    impl: quantizer implementation: "auto" picks Pallas on GPU/TPU and
      jax.numpy on CPU; "jnp", "pallas" force one ("pallas" on CPU runs
      in interpret mode: correct but slow).
    """

    bits: int = 32  # uncompressed unless a run asks for fewer
    block_size: int = 256
    scale_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    int4_codebook: Literal["nf4", "uniform"] = "nf4"
    zstd: bool = True
    zstd_level: int = 1
    stochastic_rounding: bool = False
    impl: Literal["auto", "jnp", "pallas"] = "auto"

    def validate(self) -> None:
        require(self.bits in BITS, "bits", f"must be one of {', '.join(map(str, BITS))}, got {self.bits!r}")
        lo, hi = BLOCK_SIZE_RANGE
        b = self.block_size
        require(
            isinstance(b, int) and lo <= b <= hi and b & (b - 1) == 0,
            "block_size", f"must be a power of two in [{lo}, {hi}], got {b!r}",
        )
        require(self.scale_dtype in SCALE_DTYPE_IDS, "scale_dtype",
                f"must be one of {sorted(SCALE_DTYPE_IDS)}, got {self.scale_dtype!r}")
        require(self.int4_codebook in CODEBOOKS, "int4_codebook",
                f"must be one of {sorted(CODEBOOKS)}, got {self.int4_codebook!r}")
        require(isinstance(self.zstd, bool), "zstd", "must be true or false")
        require(isinstance(self.zstd_level, int) and -7 <= self.zstd_level <= 22, "zstd_level",
                f"must be an integer in [-7, 22], got {self.zstd_level!r}")
        require(self.impl in ("auto", "jnp", "pallas"), "impl",
                f"must be 'auto', 'jnp' or 'pallas', got {self.impl!r}")

    @property
    def format(self) -> "Format":
        """The value format this config writes (fields that do not apply are dropped)."""
        q = Format(self.bits).quantized
        return Format(
            bits=self.bits,
            block_size=self.block_size if q else 0,
            scale_dtype=self.scale_dtype if q else None,
            codebook=self.int4_codebook if self.bits == 4 else None,
        )


@dataclass(frozen=True)
class Format:
    """How values are laid out in a payload: what the header says and the pack stage reads.

    Canonical: ``block_size`` is 0 and ``scale_dtype`` None unless quantized
    (bits 8/4); ``codebook`` is None unless bits is 4. Two configs that differ
    only in fields that do not apply therefore write the same bytes.
    """

    bits: int
    block_size: int = 0
    scale_dtype: str | None = None
    codebook: str | None = None

    @property
    def quantized(self) -> bool:
        return self.bits in QUANTIZED_BITS
