"""Snapshots in the simulator: the core's snapshot coordinator (``core.snapshots``) with its files kept in
memory (docs/operations.md, "Snapshots and resume").

The decisions are the network driver's, made by the same code: cut every
``checkpoint.every_merges`` merges and announce it to the learners (``SnapshotCut``,
handed to ``announce``); a cut waits for the syncer's part and for
the part of every live learner that trained (a learner that dies, or stays
silent for twice the liveness timeout, is no longer waited for); resume from
the newest complete snapshot as the next incarnation, one past every incarnation
a resume started (two resumes from one snapshot get two numbers). Writing a part or a
manifest takes no virtual time and never fails here.
"""
from __future__ import annotations

from typing import Callable

from wan_diloco.core import SyncerCore
from wan_diloco.core.barrier import StartBarrier
from wan_diloco.core.messages import SnapshotCut
from wan_diloco.core.positions import Positions
from wan_diloco.core.snapshots import Found, SnapshotComplete, SnapshotCoordinator, WriteManifest, WriteSyncerPart


class SnapshotKeeper:
    """One syncer core's (a shard's) snapshots and their parts, in memory. ``learner_parts``: learners write
    parts into these (the whole syncer's, or shard 0's of a sharded one); a shard's others hold its own part
    alone. ``announce(now_s, cut)`` sends a cut to the learners."""

    def __init__(self, core: SyncerCore, every_merges: int, learner_parts: bool, learners: int, patience_s: float,
                 barrier: StartBarrier | None = None, positions: Positions | None = None,
                 announce: Callable[[float, SnapshotCut], None] = lambda now_s, cut: None):
        self.every_merges, self.learner_parts, self.learners, self.patience_s = (
            every_merges, learner_parts, learners, patience_s)
        self.announce = announce
        # The simulation's start barrier and ledger of data positions (shard 0's): its snapshots hold them, a
        # resume restores them. A shard's others only ride along in its parts.
        self.barrier = barrier if barrier is not None else StartBarrier(learners, learners, 1.0)
        self.positions = positions if positions is not None else Positions(learners)
        self.syncer_parts: dict[int, tuple[dict, dict]] = {}  # snapshot -> the syncer's part (tensors, info)
        self.manifests: dict[int, dict] = {}
        self.complete_s: dict[int, float] = {}  # snapshot -> when it was complete (virtual s), oldest first
        self.parts_written = 0  # learner parts the syncer heard of
        self.epoch_seen = 0  # the highest incarnation a resume started (the store's INCARNATION.json)
        self.coordinator = self._coordinator(core, first_id=1)

    def _coordinator(self, core: SyncerCore, first_id: int) -> SnapshotCoordinator:
        return SnapshotCoordinator(core, self.barrier, self.positions, every_merges=self.every_merges,
                                   patience_s=self.patience_s, learners=self.learners,
                                   learner_parts=self.learner_parts, first_id=first_id)

    # The simulator's effects for this keeper's actions (``sim.effects.SyncerFx``): the files in memory.

    def part_written(self, now_s: float, a: WriteSyncerPart) -> list:
        self.syncer_parts[a.snapshot] = (a.tensors, a.info)
        return self.coordinator.on_part_written(now_s, a.snapshot, True)

    def manifest_written(self, now_s: float, a: WriteManifest) -> list:
        self.manifests[a.snapshot] = a.manifest
        return self.coordinator.on_manifest_written(now_s, a.snapshot, True)

    def completed(self, now_s: float, a: SnapshotComplete) -> None:
        self.complete_s[a.snapshot] = now_s  # kept across incarnations, as the manifests on disk

    # Events: each returns the coordinator's actions for the simulation to dispatch.

    def on_merged(self, now_s: float) -> list:
        return self.coordinator.on_merged(now_s, now_s)

    def on_metadata(self, now_s: float, learner: int, snapshot: int, epoch: int) -> list:
        """A learner's metadata reports the newest snapshot it wrote its part of."""
        if snapshot and self.coordinator.pending and epoch == self.coordinator.core.epoch:
            self.parts_written += 1
        return self.coordinator.on_metadata(now_s, learner, snapshot, epoch)

    def check(self, now_s: float) -> list:
        return self.coordinator.check(now_s)

    @property
    def complete(self) -> list[int]:
        return list(self.complete_s)

    def resume(self, now_s: float, fresh: SyncerCore) -> int:
        """``fresh`` (a new core of this run) takes up the newest complete snapshot as the next incarnation;
        returns its id. ``core.snapshots.ResumeError`` if none is complete, as a real ``--resume``."""
        coordinator = self._coordinator(fresh, first_id=self.coordinator.next_id)  # ids are never reused
        found = None
        if self.complete_s:
            snap = max(self.complete_s)
            tensors, info = self.syncer_parts[snap]
            found = Found(snap, tensors, info, self.manifests[snap], epoch_seen=self.epoch_seen)
        coordinator.resume(now_s, now_s, found, "the simulator's memory", "", self.patience_s)
        self.coordinator = coordinator
        self.epoch_seen = fresh.epoch  # as the runtime's record_incarnation
        return found.snapshot
