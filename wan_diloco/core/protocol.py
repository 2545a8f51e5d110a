"""The protocol's only schema: messages, actions and the codec interface of both cores.

These are plain values: the network driver turns each message into one
transport frame (``runtime.serde``: every field here in one small header, the
codec's bytes as the payload); the simulated driver delivers them as events
on a virtual clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.fragments import Encoded

Tensors = Mapping[str, np.ndarray]
SYNCER = "syncer"


def learner_node(learner: int) -> str:
    """Vector-clock node name of a learner."""
    return f"learner-{learner}"


class ProtocolError(ValueError):
    """A message that breaks the protocol (wrong fragment, shapes, NaN...): rejected, no state changed.

    ``field``: a short dotted name of what was wrong ("metadata.step", "clock", "upload.base_version"),
    what the syncer counts refusals by (``refused_total{field}`` on /metrics); "" when unnamed."""

    def __init__(self, message: str = "", field: str = ""):
        super().__init__(message)
        self.field = field


class IncarnationError(RuntimeError):
    """The syncer this learner talks to is not the one its model came from (another run, or a syncer
    restarted without a snapshot): continuing would mix two models, so the learner stops."""


class Codec(Protocol):
    """What the cores need of a codec (``compression.FragmentCodec`` is the one implementation)."""

    def roundtrip(self, values: Tensors) -> Encoded:
        """Encode one fragment; return the bytes and exactly what decoding them gives.

        Raises ValueError (naming the tensor) for values it refuses, e.g. NaN."""


def encode_or_refuse(codec: Codec, values: Tensors, what: str) -> Encoded:
    """``codec.roundtrip`` with a refusal turned into a ProtocolError naming ``what``."""
    try:
        return codec.roundtrip(values)
    except ProtocolError:
        raise
    except ValueError as e:
        raise ProtocolError(f"{what}: {e}") from None


# ---- messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class Metadata:
    """Learner -> syncer after every step: its counters and its measured step and sync times."""

    learner: int
    step: int
    c_steps: tuple[int, ...]
    c_tokens: tuple[int, ...]
    clock: VectorClock
    step_s: float | None = None  # learner's measured compute time per step
    sync_s: float | None = None  # learner's measured fragment sync time, syncer waits excluded
    region: str = ""
    tau: int | None = None  # the learner's overlap now (it may re-plan it from its link); bounds the grace
    epoch: int = 0  # the syncer incarnation the learner follows (0: not joined yet)
    snapshot: int = 0  # the newest snapshot whose part this learner has written durably
    recovering: bool = False  # it (re)joined without state of its own: it asks for a peer's (core.recovery)
    # Where its data stream is (opaque to the syncer, which keeps the latest and hands it back to a learner
    # that rejoins without its own snapshot part, so the stream goes on instead of replaying from the seed).
    data: str = ""
    loss: float | None = None  # its latest training loss (for /metrics; the syncer does not act on it)
    tokens: int = 0  # tokens this learner process trained on so far (tokens/s on /metrics)
    # The settings this learner runs with (``core.fingerprint``); the syncer refuses it if they differ
    # from its own. "" (the simulator, which builds both ends from one spec): not compared.
    fingerprint: str = ""


@dataclass(frozen=True)
class FragmentUpload:
    """Learner -> syncer: outer gradient Δ = Θ_base − θ for one fragment."""

    learner: int
    fragment: int
    due_step: int  # the schedule step this contribution belongs to
    base_version: int
    c_steps: int
    c_tokens: int
    clock: VectorClock
    delta: dict[str, np.ndarray]
    nbytes: int
    payload: bytes | None = None
    region: str = ""
    final: bool = False  # part of the end-of-run sync: merged with every learner's, quorum and grace aside
    epoch: int = 0  # the syncer incarnation its base version belongs to (0: not joined yet)


@dataclass(frozen=True)
class GlobalUpdate:
    """Syncer -> every learner: Θ_p(to_version) = Θ_p(from_version) + update."""

    fragment: int
    from_version: int
    to_version: int
    due_step: int
    global_step: int
    clock: VectorClock
    update: dict[str, np.ndarray]
    nbytes: int
    contributors: tuple[int, ...] = ()
    held_s: Mapping[int, float] = field(default_factory=dict)  # per contributor: time the syncer held its Δ
    payload: bytes | None = None
    final: bool = False  # the result of the end-of-run sync
    # Identity: which run, which syncer incarnation (1 at a fresh start, +1 at each resume), and the
    # snapshot this incarnation resumed from (0: a fresh start).
    run_id: str = ""
    epoch: int = 0
    resumed_from: int = 0
    snapshot: int = 0  # the newest snapshot the syncer has cut: learners write their part when it grows


@dataclass(frozen=True)
class ObjectRequest:
    """A named object a peer fetches from the syncer in bulk: ``fragment/P`` (the current global
    fragment), ``final/P`` (it after the end-of-run sync), ``donation/M`` (a peer's state for learner M)
    or ``position/M`` (learner M's data position). On the wire it travels as its ``name``."""

    kind: str
    index: int

    KINDS = ("fragment", "final", "donation", "position")
    FRAGMENT_KINDS = ("fragment", "final")

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.index}"

    @classmethod
    def parse(cls, name: str, num_fragments: int, num_learners: int) -> "ObjectRequest":
        """The request a name asks for, or ProtocolError (field ``object``) naming what is valid."""
        kind, _, index = name.partition("/")
        bound = num_fragments if kind in cls.FRAGMENT_KINDS else num_learners
        if kind not in cls.KINDS or not (index.isascii() and index.isdigit()) or index != str(int(index)) \
                or not 0 <= int(index) < bound:
            raise ProtocolError(
                f"unknown bulk object {name[:80]!r}; expected fragment/P or final/P with P in "
                f"0..{num_fragments - 1}, or donation/M or position/M with M in 0..{num_learners - 1}", "object")
        return cls(kind, int(index))


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
