"""The sans-IO cores' ``Codec`` over the wire codec.

The sender decodes its own bytes with the same decoder every receiver uses, so
what it accounts for (error feedback, the syncer's own Θ) is bit-identical to
what arrives everywhere.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from wan_diloco.compression.codec import NonFiniteError, decode, encode
from wan_diloco.compression.config import CodecConfig
from wan_diloco.core.protocol import Encoded, ProtocolError


class FragmentCodec:
    def __init__(self, cfg: CodecConfig):
        cfg.validate()
        self.cfg = cfg

    def roundtrip(self, values: Mapping[str, np.ndarray]) -> Encoded:
        try:
            data = encode(values, self.cfg)
        except NonFiniteError as e:
            raise ProtocolError(str(e)) from None
        return Encoded(values=decode(data), nbytes=len(data), payload=data)
