"""The codec's refusals: one exception family, each message naming what was wrong."""
from __future__ import annotations


class CodecError(ValueError):
    """Values or a payload the fragment codec refuses (decode side: malformed payload)."""


class EncodeError(CodecError):
    """Values that cannot be encoded: wrong tensor set, shape, dtype, or a missing PRNG key."""


class NonFiniteError(EncodeError):
    """A tensor holds NaN/Inf, or a value or scale overflows its format."""
