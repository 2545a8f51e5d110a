"""The snapshot store: one folder per snapshot, a part per process, a manifest once it is complete.

Layout under ``root``::

    00000007/syncer.safetensors       the syncer's part (global parameters, outer state, counters)
    00000007/learner-2.safetensors    learner 2's part (its train state, data position, counters)
    00000007/COMPLETE.json            written last, by the syncer, once every active process wrote its part
    params.safetensors                the latest global parameters (``save_params`` format)
    INCARNATION.json                  the highest incarnation (epoch) a resume of this run started

The manifest names the parts the snapshot holds (``parts``). A snapshot without a
valid manifest is incomplete; one whose part fails its digest is skipped for the
previous one. ``resumable`` picks what a resume takes (docs/operations.md,
"Snapshots and resume"): the newest snapshot whose syncer part verifies and that
is complete or holds a learner part (learners without one recover from a peer).
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import xxhash

from .format import CheckpointError, load_state, save_state, write_atomic

log = logging.getLogger(__name__)
MANIFEST = "COMPLETE.json"
INCARNATION = "INCARNATION.json"
_ID = re.compile(r"[0-9]{8}")


def _manifest_digest(body: Mapping[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, allow_nan=False).encode())


class SnapshotStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.skipped: list[tuple[int, str]] = []  # (snapshot, why) passed over by ``newest``

    def dir(self, snapshot: int) -> Path:
        return self.root / f"{snapshot:08d}"

    def part(self, snapshot: int, name: str) -> Path:
        return self.dir(snapshot) / f"{name}.safetensors"

    @property
    def params_path(self) -> Path:
        return self.root / "params.safetensors"

    def ids(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and _ID.fullmatch(p.name))

    def next_id(self) -> int:
        ids = self.ids()
        return ids[-1] + 1 if ids else 1

    def save_part(self, snapshot: int, name: str, tensors: Mapping[str, np.ndarray], info: Mapping[str, Any],
                  kind: str) -> int:
        return save_state(self.part(snapshot, name), tensors, info, kind)

    def load_part(self, snapshot: int, name: str, kind: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return load_state(self.part(snapshot, name), kind)

    def mark_complete(self, snapshot: int, manifest: Mapping[str, Any]) -> None:
        body = {**manifest, "snapshot": snapshot}
        write_atomic(self.dir(snapshot) / MANIFEST,
                     json.dumps({**body, "digest": _manifest_digest(body)}, sort_keys=True, indent=1).encode())

    def manifest(self, snapshot: int) -> dict[str, Any]:
        path = self.dir(snapshot) / MANIFEST
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"snapshot {snapshot} is incomplete (no {MANIFEST})") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable: {e}") from None
        if not isinstance(doc, dict) or doc.get("snapshot") != snapshot:
            raise CheckpointError(f"{path}: not the manifest of snapshot {snapshot}")
        digest = doc.pop("digest", None)
        if digest != _manifest_digest(doc):
            raise CheckpointError(f"{path}: digest mismatch: the manifest is corrupt")
        return doc

    def complete_ids(self) -> list[int]:
        out = []
        for s in self.ids():
            try:
                self.manifest(s)
                out.append(s)
            except CheckpointError:
                pass
        return out

    def newest(self, name: str, kind: str, at: int | None = None):
        """(snapshot, tensors, info, manifest) of the newest complete snapshot (or exactly ``at``) whose
        part ``name`` reads and verifies; None if there is none. Snapshots passed over are in ``skipped``."""
        for s in reversed(self.complete_ids()):
            if at is not None and s != at:
                continue
            try:
                manifest = self.manifest(s)
                tensors, info = self.load_part(s, name, kind)
                return s, tensors, info, manifest
            except CheckpointError as e:
                self.skipped.append((s, str(e)))
                log.warning("snapshot %d skipped: %s", s, e)
        return None

    def parts_present(self, snapshot: int) -> list[str]:
        """Names of the part files in a snapshot's folder (written or not yet verified)."""
        d = self.dir(snapshot)
        if not d.is_dir():
            return []
        return sorted(p.name.removesuffix(".safetensors") for p in d.iterdir() if p.name.endswith(".safetensors"))

    def missing(self, snapshot: int, learners: int) -> list[str]:
        """The parts an incomplete snapshot lacks: the syncer's, then each learner's."""
        have = set(self.parts_present(snapshot))
        return [n for n in ["syncer", *(f"learner-{m}" for m in range(learners))] if n not in have]

    def resumable(self, name: str, kind: str, learners: int):
        """(snapshot, tensors, info, manifest or None) of what a resume takes: the newest snapshot whose part
        ``name`` verifies and that is complete or holds at least one learner part (learners without a part
        recover from a peer that has one); failing that, the newest whose part ``name`` verifies at all
        (every learner then goes on from the global parameters). None if no part verifies. Snapshots passed
        over, and why, are in ``skipped``."""
        complete, fallback = set(self.complete_ids()), None
        for s in reversed(self.ids()):
            have = self.parts_present(s)
            if name not in have:
                self.skipped.append((s, f"no {name} part"))
                continue
            try:
                manifest = self.manifest(s) if s in complete else None
                tensors, info = self.load_part(s, name, kind)
            except CheckpointError as e:
                self.skipped.append((s, str(e)))
                log.warning("snapshot %d skipped: %s", s, e)
                continue
            if manifest is not None or any(p.startswith("learner-") for p in have):
                return s, tensors, info, manifest
            self.skipped.append((s, f"incomplete and without a learner part ({', '.join(self.missing(s, learners))} "
                                    f"missing)"))
            if fallback is None:
                fallback = (s, tensors, info, None)
        return fallback

    def record_incarnation(self, epoch: int, run_id: str) -> None:
        """A resume started incarnation ``epoch`` of run ``run_id``: kept (atomically) so that the next resume
        goes past it even if no snapshot completes in between (``incarnation_seen``)."""
        write_atomic(self.root / INCARNATION, json.dumps({"epoch": epoch, "run_id": run_id}, sort_keys=True).encode())

    def incarnation_seen(self) -> int:
        """The highest incarnation ``record_incarnation`` kept (0: none). CheckpointError names the file if it
        does not read: guessing low could give two incarnations one number."""
        path = self.root / INCARNATION
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable: {e}") from None
        epoch = doc.get("epoch") if isinstance(doc, dict) else None
        if type(epoch) is not int or epoch < 1:
            raise CheckpointError(f"{path}: no incarnation number >= 1 in it (epoch = {epoch!r})")
        return epoch

    def fork_refusal(self) -> str | None:
        """Why a fresh start over this folder would fork a run (it holds snapshots of an earlier start), or
        None. A syncer not told to resume refuses to start with this line."""
        found = self.ids()
        if not found:
            return None
        complete = self.complete_ids()
        return (f"{self.root} holds {len(found)} snapshot(s) ({len(complete)} complete, newest {found[-1]}) of an "
                f"earlier start; starting afresh would fork the run: resume it with --resume (launch: `wan-diloco "
                f"launch --resume RUN_DIR`), or move that folder away to start a new run")

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` complete snapshots, and incomplete ones older than those."""
        complete = self.complete_ids()
        if not complete:
            return []
        kept = set(complete[-keep:])
        doomed = [s for s in self.ids() if s not in kept and s < complete[-1]]
        for s in doomed:
            shutil.rmtree(self.dir(s), ignore_errors=True)
        return doomed
