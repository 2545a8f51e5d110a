"""Snapshots in the simulator: the runtime syncer's cut / part written / complete / resume rule, kept
in memory (docs/operations.md, "Snapshots and resume").

An adapter until the core's snapshot coordinator exists: the decisions are
the ones ``runtime/syncer.py`` makes (cut every ``checkpoint.every_merges``
merges; a cut waits for the syncer's part and for the part of every live
learner that trained; a learner that dies is no longer waited for; resume
from the newest complete snapshot as the next incarnation), on the core's
own ``SyncerCore.export``/``restore``. Writes take no virtual time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wan_diloco.core import SyncerCore


@dataclass
class _Cut:
    cut_s: float
    syncer: tuple[dict, dict]  # SyncerCore.export() at the cut
    waiting: set[int]  # learners whose part is not written yet
    learners: dict[int, Any] = field(default_factory=dict)  # learner -> its part
    complete_s: float | None = None


class SnapshotKeeper:
    """One syncer core's (a shard's) snapshots. ``learner_parts``: learners write parts into these (the
    whole syncer's, or shard 0's of a sharded one); a shard's others hold its own part alone."""

    def __init__(self, every_merges: int, learner_parts: bool):
        self.every_merges, self.learner_parts = every_merges, learner_parts
        self.merges_at_cut = 0
        self.pending: dict[int, _Cut] = {}
        self.complete: dict[int, _Cut] = {}
        self.parts_written = 0
        self.last_id = 0  # ids are never reused: a dead incarnation's cuts keep theirs (as files on disk would)

    def maybe_cut(self, now_s: float, core: SyncerCore) -> int | None:
        """Cut snapshot ``core.snapshot_id + 1`` when ``every_merges`` merges happened since the last one."""
        merges = sum(core.stats.fragment_syncs)
        if not self.every_merges or core.final_started or merges - self.merges_at_cut < self.every_merges:
            return None
        self.merges_at_cut = merges
        core.snapshot_id = self.last_id = max(self.last_id, core.snapshot_id) + 1
        # As the runtime: only learners that trained have state worth keeping.
        waiting = {m for m, ln in core.learners.items() if ln.alive and ln.step > 0} if self.learner_parts else set()
        self.pending[core.snapshot_id] = _Cut(now_s, core.export(), waiting)
        self.check(now_s, core)
        return core.snapshot_id

    def learner_saved(self, now_s: float, core: SyncerCore, learner: int, snapshot: int, part: Any) -> None:
        """Learner ``learner`` wrote its part of ``snapshot`` (it covers the earlier pending ones too)."""
        for s, cut in self.pending.items():
            if s <= snapshot and learner in cut.waiting:
                cut.waiting.discard(learner)
                cut.learners[learner] = part
        self.parts_written += 1
        self.check(now_s, core)

    def check(self, now_s: float, core: SyncerCore) -> None:
        """Mark complete what waits for no live learner any more."""
        alive = set(core.alive())
        for s in sorted(self.pending):
            cut = self.pending[s]
            cut.waiting &= alive
            if not cut.waiting:
                self.complete[s] = self.pending.pop(s)
                cut.complete_s = now_s

    def newest(self) -> tuple[int, _Cut] | None:
        if not self.complete:
            return None
        s = max(self.complete)
        return s, self.complete[s]

    def resume(self, now_s: float, fresh: SyncerCore, dead_epoch: int) -> int:
        """``fresh`` (a new core of this run) takes up the newest complete snapshot as the incarnation after
        ``dead_epoch`` (the killed one's: a snapshot cut before an earlier resume must not bring an
        incarnation number back); returns its id. RuntimeError if none is complete (a real ``--resume``
        fails the same way)."""
        found = self.newest()
        if found is None:
            raise RuntimeError("the syncer was killed before any snapshot was complete: nothing to resume from "
                               "(cut snapshots sooner: checkpoint.every_merges)")
        snap, cut = found
        tensors, info = cut.syncer
        fresh.restore(tensors, info)
        fresh.epoch = max(fresh.epoch, dead_epoch) + 1
        fresh.resumed_from = fresh.snapshot_id = snap
        fresh.resumed_after(now_s, now_s - cut.cut_s)
        self.merges_at_cut = sum(fresh.stats.fragment_syncs)
        self.pending.clear()  # cuts of the dead incarnation whose parts never all came
        return snap
