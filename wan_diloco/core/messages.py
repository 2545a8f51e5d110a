"""The wire's one message table: every message either side may send, as a frozen dataclass, and
``MESSAGES``, which lists each with who may send it, how it travels and what its fields mean.

The network driver maps these and nothing else onto transport frames (``runtime.serde``); the
simulated driver hands the same objects over as events. docs/protocol.md describes the wire for a
reimplementer; a test keeps it and this table in step.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from wan_diloco.clock import VectorClock

# The version of this table. A learner sends it in its hello (``fingerprint``'s ``protocol`` component)
# and the syncer refuses another before it reads anything else of that learner.
# 1: the first versioned table (#24): Upload frames name their kind (``upload`` or ``donation``).
# 2: the snapshot announcement is a message of its own (``SnapshotCut``), no longer ``GlobalUpdate.snapshot``.
PROTOCOL_VERSION = 2
SYNCER = "syncer"  # the syncer's sender name; a learner's is ``learner_node(m)``
MAX_STR_CHARS = 256  # every string field but the fingerprint
MAX_FINGERPRINT_CHARS = 512  # ``Metadata.fingerprint``: every setting both ends must agree on, readable
MAX_INT = (1 << 63) - 1  # every integer field is in 0..MAX_INT
MAX_LEARNERS = 1 << 20


def learner_node(learner: int) -> str:
    """Vector-clock node name (and sender name) of a learner."""
    return f"learner-{learner}"


class ProtocolError(ValueError):
    """A message that breaks the protocol (wrong fragment, shapes, NaN...): rejected, no state changed.

    ``field``: a short dotted name of what was wrong ("metadata.step", "clock", "upload.base_version"),
    what the syncer counts refusals by (``refused_total{field}`` on /metrics); "" when unnamed."""

    def __init__(self, message: str = "", field: str = ""):
        super().__init__(message)
        self.field = field


# ---- learner <-> syncer -------------------------------------------------------------------------


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
    fingerprint: str = field(default="", metadata={"max_chars": MAX_FINGERPRINT_CHARS})


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
    # Identity: which run, which syncer incarnation (1 at a fresh start; a resume takes max(every
    # incarnation seen) + 1, so two resumes from one snapshot never share one), and the
    # snapshot this incarnation resumed from (0: a fresh start).
    run_id: str = ""
    epoch: int = 0
    resumed_from: int = 0


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


# ---- the update stream's control messages, donations and bulk objects -------------------


@dataclass(frozen=True)
class Identity:
    """Syncer -> learner, the first message of every update stream: which run and syncer incarnation the
    learner is talking to. A learner that reconnects to a syncer resumed from a snapshot learns it here at
    once, before any update (and even if none comes because its own uploads are of the old incarnation)."""

    run_id: str
    epoch: int
    resumed_from: int
    # The syncer process (random per start): a syncer restarted without --resume comes back at the same
    # incarnation and run id; only this tells the learner its model is not the one it followed.
    process: str = ""


@dataclass(frozen=True)
class SnapshotCut:
    """Syncer -> every learner, the snapshot announcement: the syncer, in its incarnation ``epoch``, cut
    snapshot ``snapshot``. A learner that follows that incarnation (or a later one) and saw no newer cut
    writes its part of it, between two steps, and then reports it in ``Metadata.snapshot``. Sent when the
    syncer cuts, and after ``Barrier`` on every update stream opened later in the same incarnation."""

    snapshot: int
    epoch: int


@dataclass(frozen=True)
class Donate:
    """Syncer -> one learner (peer recovery): send your state for ``recipient`` once you have seen
    the global ``versions``."""

    recipient: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class Donation:
    """Learner -> syncer, one part of a donor's state: bytes [offset, offset + len(payload)) of a
    ``checkpoint`` state file of kind ``donation`` that is ``total_bytes`` long and whose XXH3-64 is
    ``digest``. A state travels in parts so that no single message bounds it and a failed part is sent
    again alone."""

    recipient: int
    versions: tuple[int, ...]
    offset: int
    total_bytes: int
    digest: str


@dataclass(frozen=True)
class Barrier:
    """Syncer -> learners: the start barrier (``core.barrier``), right after ``Identity`` on every update
    stream and to every learner once it is met. A learner takes no training step before ``started``."""

    started: bool
    need: int
    joined: tuple[int, ...]
    waiting_for: tuple[int, ...]


@dataclass(frozen=True)
class BulkHeader:
    """The header of a bulk fragment object (``fragment/P`` or ``final/P``): its version and the identity
    of the syncer that served it; the fragment is the frame's, the values its payload."""

    version: int
    global_step: int
    run_id: str = ""
    epoch: int = 0
    resumed_from: int = 0


class BulkFragment(typing.NamedTuple):
    """A global fragment fetched by bulk (``BulkHeader`` and its decoded values)."""

    fragment: int
    version: int
    global_step: int
    values: dict[str, np.ndarray]
    run_id: str = ""
    epoch: int = 0
    resumed_from: int = 0


# ---- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageSpec:
    """One row of the table. ``kind``: the message's name on the wire and in refusals (``<kind>.<field>``);
    ``sender``: "learner" or "syncer"; ``rpc``: how it travels (docs/protocol.md); ``fields``: every field
    with its type on the wire, unit and limit."""

    kind: str
    cls: type
    sender: str
    rpc: str
    fields: Mapping[str, str]


_INT = "int, 0..2^63-1"
_IDS = "list of int, each 0..2^63-1"
_STR = "str, at most 256 characters"
_CLOCK = "object node -> int: vector clock, nodes learner-M and syncer"
MESSAGES: tuple[MessageSpec, ...] = (
    MessageSpec("metadata", Metadata, "learner", "Metadata", {
        "learner": "frame sender learner-M; M < number of learners",
        "step": f"{_INT}: learner steps taken",
        "c_steps": f"{_IDS}: per fragment, steps since its last sync",
        "c_tokens": f"{_IDS}: per fragment, tokens since its last sync",
        "clock": _CLOCK,
        "step_s": "float or null, seconds: measured compute time per step",
        "sync_s": "float or null, seconds: measured fragment sync time, syncer waits excluded",
        "region": f"{_STR}: the learner's region",
        "tau": "int or null, steps: the learner's overlap τ now",
        "epoch": f"{_INT}: the syncer incarnation it follows (0: not joined yet)",
        "snapshot": f"{_INT}: the newest snapshot whose part it wrote durably",
        "recovering": "bool: it (re)joined without state of its own and asks for a peer's",
        "data": f"{_STR}: its data position, opaque to the syncer",
        "loss": "float or null: its latest training loss",
        "tokens": f"{_INT}: tokens this learner process trained on",
        "fingerprint": "str, at most 512 characters: the settings it runs with (core.fingerprint); \"\": not compared",
    }),
    MessageSpec("upload", FragmentUpload, "learner", "Upload", {
        "learner": "frame sender learner-M",
        "fragment": "frame routing key: fragment index p < P",
        "due_step": f"{_INT}: the schedule step this contribution belongs to",
        "base_version": f"{_INT}: the global version of fragment p its Δ is taken against",
        "c_steps": f"{_INT}: steps in this Δ",
        "c_tokens": f"{_INT}: tokens in this Δ",
        "clock": _CLOCK,
        "delta": "payload: the codec's encoding of Δ = Θ_base − θ (fragment format)",
        "nbytes": "payload length in bytes (not sent: the payload's)",
        "payload": "payload bytes",
        "region": _STR,
        "final": "bool: part of the end-of-run sync",
        "epoch": f"{_INT}: the syncer incarnation its base version belongs to",
    }),
    MessageSpec("donation", Donation, "learner", "Upload", {
        "recipient": "int < number of learners, not the donor",
        "versions": f"{_IDS}: the global versions the donor had seen, one per fragment",
        "offset": f"{_INT}, bytes: where this part starts in the state",
        "total_bytes": f"{_INT}, bytes: the whole state's length",
        "digest": "str, 16 lowercase hex digits: XXH3-64 of the whole state",
    }),
    MessageSpec("update", GlobalUpdate, "syncer", "Subscribe", {
        "fragment": "frame routing key: fragment index p",
        "from_version": f"{_INT}: the version this update applies to",
        "to_version": f"{_INT}: the version it makes",
        "due_step": f"{_INT}: the schedule step of the merged round",
        "global_step": f"{_INT}: the syncer's global step",
        "clock": _CLOCK,
        "update": "payload: the codec's encoding of Θ_p(to) − Θ_p(from), a delta (fragment format)",
        "nbytes": "payload length in bytes (not sent)",
        "contributors": f"{_IDS}: the learners merged into it",
        "held_s": "object learner id (decimal string) -> float seconds the syncer held its Δ",
        "payload": "payload bytes",
        "final": "bool: the result of the end-of-run sync",
        "run_id": _STR,
        "epoch": f"{_INT}: the syncer incarnation (1 fresh; a resume: max(every incarnation seen) + 1)",
        "resumed_from": f"{_INT}: the snapshot this incarnation resumed from (0: fresh)",
    }),
    MessageSpec("identity", Identity, "syncer", "Subscribe", {
        "run_id": _STR,
        "epoch": f"{_INT}: the syncer incarnation",
        "resumed_from": f"{_INT}: the snapshot it resumed from (0: fresh)",
        "process": f"{_STR}: random per syncer process",
    }),
    MessageSpec("barrier", Barrier, "syncer", "Subscribe", {
        "started": "bool: the barrier is met; training may start",
        "need": f"{_INT}: learners the barrier waits for",
        "joined": f"{_IDS}: learners joined so far",
        "waiting_for": f"{_IDS}: learners not joined yet",
    }),
    MessageSpec("cut", SnapshotCut, "syncer", "Subscribe", {
        "snapshot": f"{_INT}: the snapshot cut (ids grow, never reused in a run); the name of the part to write",
        "epoch": f"{_INT}: the syncer incarnation that cut it; a learner that follows a later one ignores it",
    }),
    MessageSpec("donate", Donate, "syncer", "Subscribe", {
        "recipient": "int < 2^20: the learner that gets the state",
        "versions": f"{_IDS}: send once you have seen these global versions, one per fragment",
    }),
    MessageSpec("object", ObjectRequest, "learner", "Bulk", {
        "kind": "fragment | final | donation | position",
        "index": "int: fragment p < P (fragment, final) or learner M < number of learners",
    }),
    MessageSpec("bulk", BulkHeader, "syncer", "Bulk", {
        "version": f"{_INT}: the fragment's global version",
        "global_step": f"{_INT}: the syncer's global step",
        "run_id": _STR,
        "epoch": f"{_INT}: the syncer incarnation",
        "resumed_from": f"{_INT}: the snapshot it resumed from (0: fresh)",
    }),
)
BY_KIND = {s.kind: s for s in MESSAGES}
KIND_OF = {s.cls: s.kind for s in MESSAGES}
# The snapshot announcement is ``SnapshotCut`` (syncer -> learners); a learner reports the part it wrote in
# ``Metadata.snapshot``.
