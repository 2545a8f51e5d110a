"""Sans-IO snapshot coordinator of the syncer (docs/operations.md, "Snapshots and resume").

Every ``every_merges`` merges (or when the operator asks, ``cut``) the syncer
cuts snapshot S: its core's state as of this instant is written off the event
loop (``WriteSyncerPart``), and S is announced to every learner
(``AnnounceSnapshot``: a ``SnapshotCut``, also sent on every update stream opened
later in this incarnation, ``announcement``), so each learner writes its part and
reports S in its metadata (``on_metadata``). Once the syncer's part and every waited-for learner's are
written (a learner that died, or stayed silent for ``patience_s``, is no
longer waited for: it resumes like a new learner), the manifest marks S
complete (``WriteManifest``, then ``SnapshotComplete``). ``resume`` takes up
what the store found as the next incarnation: one past every incarnation the
store has seen (the snapshot's, and ``Found.epoch_seen``, which the driver
keeps with ``record_incarnation``), so two resumes from one snapshot never share
a number; a fresh start over existing snapshots is refused (``fork_refusal``).
The driver owns the files: it writes what the actions say and reports back
with ``on_part_written`` and ``on_manifest_written``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from wan_diloco.core.barrier import StartBarrier
from wan_diloco.core.messages import SnapshotCut
from wan_diloco.core.positions import Positions
from wan_diloco.core.syncer import SyncerCore


class ResumeError(RuntimeError):
    """``--resume`` found no snapshot to resume from; the text says where it looked and why."""


class ForkRefused(RuntimeError):
    """A syncer started without ``--resume`` over a checkpoint.dir that holds snapshots: it would start the
    run's model again from scratch beside (and over) the one those snapshots hold."""


@dataclass(frozen=True)
class WriteSyncerPart:
    """Driver: write the syncer's part of ``snapshot`` (``tensors``, ``info``) off the event loop, then
    call ``on_part_written`` with whether it worked."""

    snapshot: int
    tensors: dict
    info: dict


@dataclass(frozen=True)
class AnnounceSnapshot:
    """Driver: send ``msg`` to every learner (on the update stream; a newer cut replaces an older one not yet
    delivered)."""

    msg: SnapshotCut


@dataclass(frozen=True)
class WriteManifest:
    """Driver: every part of ``snapshot`` is written: write its ``manifest`` (marks it complete), then call
    ``on_manifest_written`` with whether it worked."""

    snapshot: int
    manifest: dict


@dataclass(frozen=True)
class SnapshotComplete:
    """Driver: ``snapshot`` is complete (``parts``, the syncer's part ``syncer_bytes``, ``seconds`` from the
    cut): drop snapshots older than the kept ones and report it."""

    snapshot: int
    parts: tuple[str, ...]
    syncer_bytes: int
    seconds: float


@dataclass(frozen=True)
class Found:
    """What the driver's store found to resume from: the snapshot, its syncer part (``tensors``, ``info``),
    its manifest (None: not marked complete), the snapshots passed over and why, for an incomplete
    snapshot of an unsharded syncer the parts it lacks (``missing``) and the learner parts it has (``have``),
    and the highest incarnation an earlier resume of this run recorded (``epoch_seen``, 0: none)."""

    snapshot: int
    tensors: dict
    info: dict
    manifest: dict | None
    skipped: tuple[tuple[int, str], ...] = ()
    missing: tuple[str, ...] | None = None
    have: tuple[str, ...] = ()
    epoch_seen: int = 0


def fork_refusal(resume: bool, existing: str | None) -> str | None:
    """A fresh start over existing snapshots (``existing``: the store's line about them) would fork the run:
    the learners (which keep the run id and incarnation 1) would feed fresh parameters, and the final file
    would overwrite the real one. The line to refuse with, or None."""
    return None if resume else existing


@dataclass
class Pending:
    """A snapshot cut and not complete yet."""

    learners: set[int]  # whose parts it still waits for
    cut_s: float
    versions: list[int]
    syncer: bool = False  # the syncer's part is written
    parts: list[str] = field(default_factory=list)  # learner parts written
    syncer_bytes: int = 0


class SnapshotCoordinator:
    """The syncer's snapshots (see the module docstring). ``learner_parts``: learners write parts into this
    syncer's snapshots (shard 0's; the other shards keep only their own). ``enabled``: there is a store."""

    def __init__(self, core: SyncerCore, barrier: StartBarrier, positions: Positions, *, every_merges: int,
                 patience_s: float, learners: int, learner_parts: bool = True, enabled: bool = True,
                 first_id: int = 1):
        self.core, self.barrier, self.positions = core, barrier, positions
        self.every_merges, self.patience_s, self.learners = every_merges, patience_s, learners
        self.learner_parts, self.enabled = learner_parts, enabled
        self.next_id = first_id  # the store's next free id at the start: ids are never reused
        self.pending: dict[int, Pending] = {}
        self.writing: dict[int, tuple[Pending, float]] = {}  # manifests being written: (what, seconds from cut)
        self.merges_at_cut = 0
        self.complete: list[int] = []
        self.stopping = False
        self.resumed: dict | None = None  # what a resume took up (snapshot, epoch, snapshots skipped, notes)

    # ---- the cut --------------------------------------------------------------------

    def due(self) -> bool:
        return bool(self.every_merges) and sum(self.core.stats.fragment_syncs) - self.merges_at_cut >= self.every_merges

    def on_merged(self, now_s: float, unix_s: float) -> list:
        """The core acted: a cut once ``every_merges`` merges happened since the last."""
        return self.cut(now_s, unix_s) if self.due() else []

    def cut(self, now_s: float, unix_s: float) -> list:
        """Cut a snapshot now (``unix_s``: the wall clock, kept so a resume knows how long learners trained
        on since); nothing when there is nowhere to write or the run is ending."""
        if not self.enabled or self.core.final_started:
            return []
        snap = max(self.next_id, self.core.snapshot_id + 1)
        self.next_id = snap + 1
        self.merges_at_cut = sum(self.core.stats.fragment_syncs)
        tensors, info = self.core.cut_snapshot(snap)
        info["cut_unix_s"] = unix_s  # a resume from it allows learners' steps since (core.pace)
        info["barrier_started"] = self.barrier.started
        # Each learner's data position as of its latest metadata: a learner whose own part turns out unusable
        # at a resume takes it from here (``position/M``) instead of reading its shard again from the start.
        info["positions"] = self.positions.export()
        # The cut holds the learners that trained: one that never took a step (still joining or compiling)
        # has no state of its own to keep, and waiting for its part would leave every snapshot incomplete.
        waiting = ({m for m, ln in self.core.learners.items() if ln.alive and ln.step > 0}
                   if self.learner_parts else set())
        self.pending[snap] = Pending(waiting, now_s, list(self.core.version))
        announce = self.announcement()
        return [WriteSyncerPart(snap, tensors, info), *([AnnounceSnapshot(announce)] if announce else [])]

    def announcement(self) -> SnapshotCut | None:
        """The newest cut of this incarnation, for the learners (whose parts are in this syncer's snapshots);
        None if it cut none since it started or resumed."""
        if not self.learner_parts or self.core.snapshot_id <= self.core.resumed_from:
            return None
        return SnapshotCut(self.core.snapshot_id, self.core.epoch)

    # ---- parts and completion -------------------------------------------------------

    def on_part_written(self, now_s: float, snapshot: int, ok: bool, nbytes: int = 0) -> list:
        """The syncer's part of ``snapshot`` was written (``ok``) or not: then the snapshot is given up."""
        if not ok:
            self.pending.pop(snapshot, None)
            return []
        pending = self.pending.get(snapshot)
        if pending is None:
            return []
        pending.syncer, pending.syncer_bytes = True, nbytes
        return self.check(now_s)

    def on_metadata(self, now_s: float, learner: int, snapshot: int, epoch: int) -> list:
        """A learner's metadata says it wrote its part of ``snapshot`` (and of every earlier one it was cut
        for), in this incarnation ``epoch``."""
        if not snapshot or not self.pending or epoch != self.core.epoch:
            return []
        for s, pending in self.pending.items():
            if s <= snapshot and learner in pending.learners:
                pending.learners.discard(learner)
                pending.parts.append(f"learner-{learner}")
        return self.check(now_s)

    def check(self, now_s: float) -> list:
        """Every pending snapshot whose parts are all written gets its manifest (a learner that died, or
        stayed silent for ``patience_s`` since the cut, is no longer waited for)."""
        if self.stopping or not self.pending:
            return []  # learners leave because everything stops: a snapshot missing their parts is worse
        alive, actions = set(self.core.alive()), []
        for snap in sorted(self.pending):
            pending = self.pending[snap]
            if now_s - pending.cut_s > self.patience_s:
                pending.learners.clear()
            pending.learners &= alive
            if not pending.syncer or pending.learners:
                continue
            del self.pending[snap]
            parts = ["syncer", *sorted(pending.parts)]
            self.writing[snap] = (pending, round(now_s - pending.cut_s, 3))
            actions.append(WriteManifest(snap, {"run_id": self.core.run_id, "epoch": self.core.epoch, "parts": parts,
                                                "versions": pending.versions, "learners": self.learners}))
        return actions

    def on_manifest_written(self, now_s: float, snapshot: int, ok: bool) -> list:
        """The manifest of ``snapshot`` was written: it is complete (not ``ok``: it stays incomplete)."""
        pending, seconds = self.writing.pop(snapshot, (None, 0.0))
        if not ok or pending is None:
            return []
        self.complete.append(snapshot)
        return [SnapshotComplete(snapshot, ("syncer", *sorted(pending.parts)), pending.syncer_bytes, seconds)]

    def stop(self) -> None:
        """Everything stops: no snapshot is completed from now on."""
        self.stopping = True

    @property
    def last_complete(self) -> int | None:
        return self.complete[-1] if self.complete else None

    # ---- resume ---------------------------------------------------------------------

    def resume(self, now_s: float, unix_s: float, found: Found | None, where: str, run_id: str,
               default_age_s: float, skipped: tuple[tuple[int, str], ...] = ()) -> dict:
        """Take up ``found`` as the next incarnation: the core's state, an epoch past every one the store has
        seen (the driver then records it: ``SnapshotStore.record_incarnation``), the barrier as it was
        (a started run stays started), the learners' data positions. ResumeError says why not (nothing
        found in ``where``, another run, a snapshot that does not fit this config). ``default_age_s``: how
        long learners may have trained on since a cut of unknown time (an older snapshot); ``skipped``:
        what the store passed over when it found nothing."""
        if found is None:
            raise no_snapshot(where, skipped)
        snap, info = found.snapshot, found.info
        if run_id and info.get("run_id") != run_id:
            raise ResumeError(f"snapshot {snap} in {where} is of run {info.get('run_id')!r}, "
                              f"the config says run.run_id = {run_id!r}")
        try:
            self.core.restore(found.tensors, info)
        except (ValueError, KeyError, TypeError) as e:
            raise ResumeError(f"snapshot {snap} in {where} does not fit this config: {e}") from None
        self.core.next_incarnation(snap, found.epoch_seen)
        cut = info.get("cut_unix_s")  # learners trained on from the cut until now (absent: an older snapshot)
        self.core.resumed_after(now_s, unix_s - cut if isinstance(cut, (int, float)) else default_age_s)
        self.merges_at_cut = sum(self.core.stats.fragment_syncs)
        notes = [f"snapshot {s} passed over: {why}" for s, why in found.skipped]
        if found.manifest is None and found.missing is not None:
            if not found.missing:
                notes.append(f"snapshot {snap} has every part but was not marked complete (the run stopped first)")
            else:
                have = list(found.have)
                notes.append(f"snapshot {snap} is incomplete: no part of {', '.join(found.missing)}; "
                             + (f"they recover from a peer ({', '.join(have)} resume their parts)" if have else
                                "every learner goes on from the global parameters with a fresh inner optimizer"))
        self.barrier.resumed(info.get("barrier_started", self.core.global_step > 0))
        self.positions.restore(info.get("positions"))
        self.resumed = {"snapshot": snap, "epoch": self.core.epoch, "skipped": list(found.skipped),
                        "versions": list(self.core.version), "global_step": self.core.global_step,
                        "complete": found.manifest is not None, "notes": notes}
        return self.resumed


def no_snapshot(where: str, skipped: list[tuple[int, str]]) -> ResumeError:
    """The error of a resume that found nothing usable in ``where`` (``skipped``: what it passed over)."""
    why = "; ".join(f"snapshot {s}: {e}" for s, e in skipped) or "no snapshot was ever cut"
    return ResumeError(f"no snapshot to resume from in {where}: {why}. Nothing of this run can be "
                       f"taken up: start it again from its config")

