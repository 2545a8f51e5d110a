"""The cores' actions, errors and codec interface; the messages (the wire's one table) are in
``core.messages`` and re-exported here.

These are plain values: the network driver turns each message into one
transport frame (``runtime.serde``: every field in one small header, the
codec's bytes as the payload); the simulated driver delivers them as events
on a virtual clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np

from wan_diloco.fragments import Encoded
# The messages live in ``core.messages`` (the wire's one table); importable from here as before.
from wan_diloco.core.messages import (  # noqa: F401
    MESSAGES, PROTOCOL_VERSION, SYNCER, Barrier, BulkFragment, BulkHeader, Donate, Donation, FragmentUpload,
    GlobalUpdate, Identity, Metadata, ObjectRequest, ProtocolError, SnapshotCut, learner_node,
)

Tensors = Mapping[str, np.ndarray]


class IncarnationError(RuntimeError):
    """The syncer this learner talks to is not the one its model came from (another run, or a syncer
    restarted without a snapshot): continuing would mix two models, so the learner stops."""


class Codec(Protocol):
    """What the cores need of a codec (``compression.FragmentCodec`` is the one implementation)."""

    def roundtrip(self, values: Tensors, *, in_place: bool = False) -> Encoded:
        """Encode one fragment; return the bytes and exactly what decoding them gives (``in_place``: it
        may write them over ``values``, which the caller no longer needs).

        Raises ValueError (naming the tensor) for values it refuses, e.g. NaN."""


def encode_or_refuse(codec: Codec, values: Tensors, what: str, in_place: bool = False) -> Encoded:
    """``codec.roundtrip`` with a refusal turned into a ProtocolError naming ``what``."""
    try:
        return codec.roundtrip(values, in_place=True) if in_place else codec.roundtrip(values)
    except ProtocolError:
        raise
    except ValueError as e:
        raise ProtocolError(f"{what}: {e}") from None


# ---- actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class SendMetadata:
    msg: Metadata


@dataclass(frozen=True)
class Snapshot:
    """Driver: copy θ_p to host and hand it to ``LearnerCore.snapshot`` (with ``final``)."""

    fragment: int
    due_step: int
    final: bool = False


@dataclass(frozen=True)
class SendFragment:
    msg: FragmentUpload


@dataclass(frozen=True)
class ApplyGlobal:
    """Driver: θ_p ← α·θ_p + (1−α)·values, or with ``shift`` θ_p ← θ_p + values. See :meth:`mixed`."""

    fragment: int
    values: Mapping[str, np.ndarray]
    alpha: float
    shift: bool = False

    def mixed(self, current: Mapping[str, Any]) -> dict[str, Any]:
        """The fragment's new tensors from its current ones (numpy or jax arrays alike)."""
        if self.shift:
            return {n: current[n] + v for n, v in self.values.items()}
        if self.alpha == 0:
            return dict(self.values)
        return {n: self.alpha * current[n] + (1 - self.alpha) * v for n, v in self.values.items()}


@dataclass(frozen=True)
class Resync:
    """Driver: the learner missed versions of fragment p; fetch the current global fragment."""

    fragment: int
    have_version: int
    want_version: int


@dataclass(frozen=True)
class Rejoin:
    """Driver: the syncer resumed from a snapshot (a new incarnation): fetch every global fragment and
    hand them to ``LearnerCore.join``; what was in flight belongs to the old incarnation."""

    epoch: int
    resumed_from: int


@dataclass(frozen=True)
class SaveState:
    """Driver: write this learner's part of snapshot ``snapshot``, then call ``LearnerCore.saved``."""

    snapshot: int


@dataclass(frozen=True)
class Broadcast:
    msg: GlobalUpdate


@dataclass(frozen=True)
class SetTimer:
    """Driver: call ``SyncerCore.on_timer(key)`` at ``at_s`` (same clock as the events)."""

    key: tuple[int, int]
    at_s: float


FINAL_TIMER = (-1, -1)  # SetTimer key of the end-of-run sync's deadline


class Ema:
    """Exponential moving average; ``value`` is None until the first sample."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
