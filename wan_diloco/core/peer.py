"""Sans-IO peer recovery, the learner's side (docs/method.md, "Recovery"; the syncer's side is
``core.recovery.Donations``).

As a recipient (:class:`PeerRequest`): a learner that (re)joined without a state of its own asks the
syncer for a healthy peer's; while the syncer says nobody is healthy yet it asks again (for
``patience_s``), while the donor's state is still arriving it asks again (until the deadline), and
any other answer ends the request: it goes on from Θ alone.

As a donor (:class:`Donor`): the syncer asks it for its state for a recipient that saw global
versions V; it answers once it has seen V itself (its state is then at least as new), without
stopping its training.

What a donation (and a snapshot part) holds is :func:`state_tensors`; :func:`named_digest` says whether
two copies of it are the same bit for bit.

The data position the syncer keeps for each learner (from its metadata) is read back with
:func:`position_from_bytes`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from wan_diloco import tree

# What the syncer's refusals of a donation request say (runtime/syncer.py, core.recovery.Donations).
NOBODY_HEALTHY = "no healthy learner"
STILL_ARRIVING = "still arriving"
ASK_AGAIN_AFTER_S = 1.0  # between two requests while nobody is healthy yet


def peer_wait_s(donor_timeout_s: float, call_timeout_s: float, upload_s: float) -> float:
    """How long a recipient waits for a peer's state: each donor gets ``donor_timeout_s`` without
    progress, and the state crosses two links (donor -> syncer -> here), each taking ``upload_s`` at
    the transport's slowest planned rate."""
    return 2 * donor_timeout_s + call_timeout_s + 2 * upload_s


@dataclass(frozen=True)
class AskAgain:
    """Driver: request the peer state again, after ``after_s``; with ``resend_metadata``, metadata flagged
    ``recovering`` first (the syncer looks for a donor again on it)."""

    after_s: float
    resend_metadata: bool


class PeerRequest:
    """A recipient's request for a peer's state, from its first ask to the state or a give-up."""

    def __init__(self, now_s: float, patience_s: float, wait_s: float):
        self.started_s = now_s
        self.patient_until_s = now_s + patience_s
        self.deadline_s = now_s + wait_s

    def wait_s(self, now_s: float) -> float:
        """How long the driver may wait for the current request's answer."""
        return max(0.0, self.deadline_s - now_s)

    def on_refused(self, now_s: float, details: str) -> AskAgain | None:
        """The syncer refused the request saying ``details``; ``AskAgain`` or None (give up)."""
        if NOBODY_HEALTHY in details and now_s < self.patient_until_s:
            return AskAgain(ASK_AGAIN_AFTER_S, resend_metadata=True)
        if STILL_ARRIVING in details and now_s < self.deadline_s:
            return AskAgain(0.0, resend_metadata=False)
        return None


@dataclass(frozen=True)
class SendState:
    """Driver: copy this learner's state to host (training pauses only for this) and send it as donation
    parts for ``recipient``, naming ``versions`` (in order: the syncer appends each part)."""

    recipient: int
    versions: tuple[int, ...]


class Donor:
    """The donations one learner was asked for and has not sent yet."""

    def __init__(self, learner: int):
        self.m = learner
        self.asked: dict[int, tuple[int, ...]] = {}  # recipient -> the versions it saw

    def on_donate(self, now_s: float, recipient: int, versions: tuple[int, ...]) -> list[SendState]:
        """The syncer asks for this learner's state for ``recipient`` (never for itself: a learner that
        recovers is no donor)."""
        if recipient != self.m:
            self.asked[recipient] = tuple(versions)
        return []

    def on_versions(self, now_s: float, versions: list[int]) -> list[SendState]:
        """This learner's global versions now: the donations it can serve (it has seen what each recipient
        saw; the others wait for a later update)."""
        out = []
        for r, seen in list(self.asked.items()):
            if len(seen) != len(versions) or any(v < w for v, w in zip(versions, seen)):
                continue
            del self.asked[r]
            out.append(SendState(r, seen))
        return out


def state_tensors(core, params, opt_state, train_step) -> tuple[dict, dict]:
    """Host copies of what a donation and a snapshot part both hold: the learner core's protocol state
    (``LearnerCore.export``), parameters, inner optimizer and train step."""
    tensors, info = core.export()
    tensors.update(tree.to_named(params, "params"))
    tensors.update(tree.to_named(opt_state, "opt"))
    info.update(train_step=int(train_step))
    return tensors, info


def named_digest(tensors: dict, prefix: str) -> str:
    """SHA-256 over the tensors whose names start with ``prefix`` (names, dtypes, bytes, in name order):
    equal digests on donor and recipient mean the state arrived bit for bit."""
    h = hashlib.sha256()
    for name in sorted(n for n in tensors if n.startswith(prefix)):
        a = np.asarray(tensors[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def position_from_bytes(data: bytes) -> dict[str, Any] | None:
    """The data position the syncer kept for a learner (its latest metadata's), or None when it has none.
    ValueError if it is not one (JSON of an object)."""
    if not data:
        return None
    position = json.loads(bytes(data).decode("utf-8"))
    if not isinstance(position, dict):
        raise ValueError(f"a data position is a JSON object, got {type(position).__name__}")
    return position


def position_field(position: dict[str, Any] | None, max_chars: int) -> str:
    """What a learner's metadata carries as its data position: "" until it knows where its data stream is
    (the join's would replace the one the syncer keeps for it), and for one too long for the field
    (never the built-in streams'; a custom one just loses it)."""
    if position is None:
        return ""
    text = json.dumps(position, separators=(",", ":"))
    return text if len(text) <= max_chars else ""
