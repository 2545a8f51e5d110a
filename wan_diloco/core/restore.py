"""Sans-IO: where a (re)starting learner's own state comes from (docs/operations.md, "Resume").

Right after its join (it holds the global parameters Θ), a learner takes up, in this order of
preference:

1. with ``--resume``, its own part of the snapshot the syncer resumed from, unless it *trained past
   that snapshot* (it wrote a part of a later one before it died: its optimizer, residuals and data
   position in the resumed snapshot are older than its peers', and going back would read data again);
2. else, in a run already under way (global step > 0): the data position the syncer kept for it, then
   a healthy peer's state (parameters, inner optimizer, residuals; ``peer_recovery``);
3. if its own part was missing or broken and no peer gave a state: the newest earlier part of its
   own that verifies (an older optimizer beats a fresh one);
4. else Θ alone, with a fresh inner optimizer (at a run's start nobody has trained: nothing to copy).

:class:`Resume` walks that list: the driver feeds it what the store and the network answered and
does what its actions say. Every branch says what happened in a :class:`Report`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wan_diloco.core.reports import Report, warning

Tensors = dict[str, Any]


@dataclass(frozen=True)
class LoadPart:
    """Driver: read this learner's part of ``snapshot`` from its store, then call ``Resume.on_part`` with its
    (tensors, info), or ``Resume.on_part_failed`` with why it could not be read or verified."""

    snapshot: int
    fallback: bool  # an earlier snapshot's part (step 3), not the resumed one


@dataclass(frozen=True)
class InstallPart:
    """Driver: take up a verified part: the inner optimizer from ``tensors`` (``opt/...``), the error-feedback
    residuals (``LearnerCore.restore_feedback``), the data position ``data``; then its train step becomes
    max(``train_step``, the global step), the core's step moves on to ``step`` (``LearnerCore.advance``) and
    its token count is ``tokens``. Then ``Resume.on_installed`` (or ``on_part_failed`` if a piece did not
    fit this model)."""

    snapshot: int
    fallback: bool
    tensors: Tensors
    data: Any
    train_step: int
    step: int
    tokens: int


@dataclass(frozen=True)
class TakeUpPosition:
    """Driver: fetch the data position the syncer kept for this learner (``ObjectRequest("position", m)``)
    and go on with the data stream from there (``position_from_bytes``); from now on its metadata carries
    its position."""


@dataclass(frozen=True)
class RecoverFromPeer:
    """Driver: ask the syncer for a healthy peer's state (``core.peer.PeerRequest``, with ``patience_s``
    while nobody is healthy yet), install it and replay the updates that arrived meanwhile; then
    ``Resume.on_peer`` with how it went."""

    patience_s: float


ResumeAction = LoadPart | InstallPart | TakeUpPosition | RecoverFromPeer | Report


def part_problem(info: dict[str, Any], run_id: str, learner: int) -> str | None:
    """Why a part read from the store is not this learner's of this run, or None."""
    if info.get("run_id") != run_id or info.get("learner") != learner:
        return f"the part is of run {info.get('run_id')!r}, learner {info.get('learner')}"
    return None


def trained_past(snapshot: int, parts: tuple[int, ...]) -> int | None:
    """The newest snapshot after ``snapshot`` this learner wrote a part of (it trained past ``snapshot``
    before it died), or None."""
    later = [i for i in parts if i > snapshot]
    return max(later) if later else None


class Resume:
    """One learner's take-up of its own state after a join (the module's list)."""

    def __init__(self, learner: int, resume: bool, peer_recovery: bool, learners: int, donor_timeout_s: float):
        self.m, self.resume, self.peer_recovery = learner, resume, peer_recovery
        self.learners, self.donor_timeout_s = learners, donor_timeout_s
        self.recovery: dict | None = None  # how it went, for the learner's final report
        self.restored = False  # its own (or an earlier) snapshot part was taken up
        self._snap, self._run_id, self._step = 0, "", 0
        self._parts: tuple[int, ...] | None = None
        self._unusable = False
        self._earlier: list[int] = []
        self._patience_s = 0.0

    def on_joined(self, now_s: float, run_id: str, resumed_from: int, step: int,
                  parts: tuple[int, ...] | None) -> list[ResumeAction]:
        """Joined the syncer (run ``run_id``, resumed from snapshot ``resumed_from``, 0 if none, below 0 if
        only syncer shards other than 0 resumed last: ``core.shards.OTHER_SHARD_RESUMED``) at global step
        ``step``. ``parts``: the snapshots this learner's store holds a part of (None: no store)."""
        self._snap, self._run_id, self._step, self._parts = max(resumed_from, 0), run_id, step, parts
        self._unusable, self.restored = False, False
        if not self.resume:
            return self._without_part()
        if resumed_from <= 0 or parts is None:
            why = ("the syncer started fresh, not from a snapshot" if not resumed_from else
                   "checkpoint.dir is empty" if resumed_from > 0 else
                   "shard 0, which keeps the learners' parts, did not resume last: its state is newer than any part")
            return [warning(self.m, f"--resume: learner {self.m}: nothing to resume ({why})"), *self._without_part()]
        return [LoadPart(resumed_from, fallback=False)]

    def on_part(self, now_s: float, snapshot: int, fallback: bool, tensors: Tensors,
                info: dict[str, Any]) -> list[ResumeAction]:
        """The store gave this learner's part of ``snapshot`` (its checksums verified)."""
        problem = part_problem(info, self._run_id, self.m)
        if problem is not None:
            return self.on_part_failed(now_s, snapshot, fallback, problem)
        later = trained_past(snapshot, self._parts or ())
        if later is not None and not fallback:
            return [warning(self.m, f"--resume: learner {self.m}: it trained past snapshot {snapshot} (it wrote a "
                                    f"part of snapshot {later}): recovering from a peer instead of going back"),
                    *self._without_part()]
        try:
            counters = int(info["train_step"]), int(info["step"]), int(info["tokens"])
            data = info["data"]
        except (KeyError, TypeError, ValueError) as e:
            return self.on_part_failed(now_s, snapshot, fallback, str(e))
        return [InstallPart(snapshot, fallback, tensors, data, *counters)]

    def on_part_failed(self, now_s: float, snapshot: int, fallback: bool, why: str) -> list[ResumeAction]:
        """The part of ``snapshot`` was missing, broken, of another run or learner, or did not fit."""
        if fallback:
            return self._next_earlier()
        self._unusable = True
        return [warning(self.m, f"--resume: learner {self.m}: no usable part of snapshot {snapshot} ({why}); "
                                f"recovering its state from a peer, else from an earlier snapshot's part"),
                *self._without_part()]

    def on_installed(self, now_s: float, snapshot: int, fallback: bool, step: int) -> list[ResumeAction]:
        """The part of ``snapshot`` is taken up; ``step``: the learner's step now."""
        self.restored = True
        out: list[ResumeAction] = [Report({"event": "resumed", "role": "learner", "learner": self.m,
                                           "snapshot": snapshot, "step": step, **({"fallback": True} if fallback else {})})]
        if fallback:
            self.recovery = {"from_peer": False, "from_snapshot": snapshot}
            out.append(warning(self.m, f"--resume: learner {self.m}: state taken from its part of the earlier snapshot "
                                       f"{snapshot} (its part of snapshot {self._snap} was unusable and no peer gave one)"))
        return out

    def on_peer(self, now_s: float, recovery: dict, step: int) -> list[ResumeAction]:
        """How the request for a peer's state went: ``recovery["from_peer"]`` says whether it got one (else
        ``recovery["why"]`` says why not); ``step``: the learner's step now."""
        self.recovery = recovery
        if recovery.get("from_peer"):
            return [Report({"event": "recovered", "role": "learner", "learner": self.m, "step": step, **recovery})]
        alone = ": going on from the global parameters with a fresh inner optimizer" if not self._patience_s else ""
        return [warning(self.m, f"no peer state ({recovery.get('why')})" + alone), *self._after_no_peer()]

    # ---- internals ------------------------------------------------------------------

    def _without_part(self) -> list[ResumeAction]:
        if self._step <= 0:  # a run's start: nobody has trained yet, there is no state worth copying
            return []
        if not self.peer_recovery:
            return [TakeUpPosition(), *self._after_no_peer()]
        # A resumed run's peers are taking up their own parts meanwhile: wait for one to be ready.
        self._patience_s = self.donor_timeout_s if self.resume and self._snap and self.learners > 1 else 0.0
        return [TakeUpPosition(), RecoverFromPeer(self._patience_s)]

    def _after_no_peer(self) -> list[ResumeAction]:
        if not (self._unusable and self._parts is not None):
            return []
        self._earlier = sorted((i for i in self._parts if i < self._snap), reverse=True)
        return self._next_earlier()

    def _next_earlier(self) -> list[ResumeAction]:
        if self._earlier:
            return [LoadPart(self._earlier.pop(0), fallback=True)]
        return [warning(self.m, f"--resume: learner {self.m}: no peer state and no earlier part of its own: going on "
                                f"from the global parameters with a fresh inner optimizer and data order")]
