"""The syncer's snapshot files: what ``core.snapshots.SnapshotCoordinator`` decides, written and read.

``SnapshotFiles`` is mixed into ``runtime.syncer.SyncerService``: it writes the
syncer's part off the event loop and the manifest, drops old snapshots, and at
``--resume`` reads what the ``SnapshotStore`` finds (the newest snapshot whose
part verifies, an earlier one when it does not) for the coordinator to take up,
and records the incarnation it starts (``SnapshotStore.record_incarnation``).
"""
from __future__ import annotations

import asyncio
import logging
import time

from wan_diloco.checkpoint import CheckpointError
from wan_diloco.core.snapshots import Found, ResumeError, SnapshotComplete, WriteManifest, WriteSyncerPart
from wan_diloco.runtime.events import emit

log = logging.getLogger("wan_diloco.runtime.syncer")


class SnapshotFiles:
    """Mixed into ``SyncerService``: the IO of its snapshots."""

    def _resume(self) -> None:
        if self.store is None:
            raise ResumeError("--resume needs checkpoint.dir (where the snapshots are)")
        # Unsharded: an incomplete snapshot whose learner parts are partly there will do (its other learners
        # recover from peers that have theirs). A shard's store holds only its own part: complete ones only.
        got = (self.store.resumable("syncer", "syncer", self.M) if self.S == 1 else
               self.store.newest("syncer", "syncer"))
        found = None
        if got is not None:
            snap, tensors, info, manifest = got
            incomplete = manifest is None and self.S == 1
            try:
                seen = self.store.incarnation_seen()
            except CheckpointError as e:
                raise ResumeError(f"--resume: {e}; it keeps the run's highest incarnation: restore it, or write "
                                  f"{{\"epoch\": N}} with N above every incarnation this run had") from None
            found = Found(snap, tensors, info, manifest, tuple(self.store.skipped),
                          tuple(self.store.missing(snap, self.M)) if incomplete else None,
                          tuple(n for n in self.store.parts_present(snap) if n.startswith("learner-")), seen)
        resumed = self.snapshots.resume(self.now(), time.time(), found, str(self.store.root), self.cfg.run.run_id,
                                        self.cfg.syncer.liveness_timeout_s, tuple(self.store.skipped))
        self._record_incarnation(resumed["epoch"])
        for note in resumed["notes"]:
            log.warning("--resume: %s", note)

    def _record_incarnation(self, epoch: int) -> None:
        """Before any learner hears of it: the next resume must go past this incarnation. A full or failing
        disk is retried for ``checkpoint.final_write_retry_s`` (it often clears: old snapshots dropped, space
        freed), as the final parameters are; after that the resume fails rather than risk reusing a number."""
        retry_s = self.cfg.checkpoint.final_write_retry_s
        deadline, wait_s, warned = time.monotonic() + retry_s, 0.5, False
        while True:
            try:
                self.store.record_incarnation(epoch, self.core.run_id)
                return
            except OSError as e:
                if time.monotonic() + wait_s > deadline:
                    raise ResumeError(f"--resume: could not record incarnation {epoch} in {self.store.root} "
                                      f"(tried for {retry_s:g} s, checkpoint.final_write_retry_s): {e}") from None
                if not warned:
                    log.warning("--resume: could not record incarnation %d (%s); retrying for %g s", epoch, e, retry_s)
                    warned = True
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, 5.0)

    def snapshot_now(self) -> int | None:
        """Cut a snapshot now (its parts are written in the background); returns its id, or None when
        there is nowhere to write or the run is ending."""
        actions = self.snapshots.cut(self.now(), time.time())
        self._act(actions)
        return actions[0].snapshot if actions else None

    async def _write_syncer_part(self, a: WriteSyncerPart) -> None:
        try:
            nbytes = await asyncio.to_thread(self.store.save_part, a.snapshot, "syncer", a.tensors, a.info, "syncer")
        except (OSError, CheckpointError) as e:
            self._write_failed(f"snapshot {a.snapshot}: could not write the syncer's part", e)
            self._act(self.snapshots.on_part_written(self.now(), a.snapshot, ok=False))
            return
        self.write_error = None
        self._act(self.snapshots.on_part_written(self.now(), a.snapshot, ok=True, nbytes=nbytes))

    def write_part(self, a: WriteSyncerPart) -> None:
        asyncio.get_running_loop().create_task(self._write_syncer_part(a))

    def write_manifest(self, a: WriteManifest) -> None:
        try:
            self.store.mark_complete(a.snapshot, a.manifest)
        except OSError as e:
            self._write_failed(f"snapshot {a.snapshot}: could not write its manifest", e)
            self.snapshots.on_manifest_written(self.now(), a.snapshot, ok=False)
            return
        self._act(self.snapshots.on_manifest_written(self.now(), a.snapshot, ok=True))

    def snapshot_complete(self, a: SnapshotComplete) -> None:
        removed = self.store.gc(self.cfg.checkpoint.keep)
        emit({"event": "snapshot", "role": "syncer", "snapshot": a.snapshot, "parts": list(a.parts),
              "syncer_bytes": a.syncer_bytes, "seconds": a.seconds, "removed": removed})
