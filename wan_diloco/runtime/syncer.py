"""The syncer service: ``SyncerCore`` behind the transport's ``Handler``, on one asyncio loop.

Every event is handled on the loop thread (the core is not thread-safe);
timers come from ``SetTimer`` via ``loop.call_later``, liveness from a periodic
``tick`` and from subscribe streams that end. Broadcasts go through the
transport's drop-to-latest fan-out; a learner that missed versions fetches the
full fragment by bulk (``fragment/P``), as does a learner that (re)joins.

End of run: learners upload every fragment flagged ``final``; the core merges
them once every live learner has (or ``syncer.final_timeout_s`` after the
first), and the final fragments are served as ``final/P`` (a fetch waits for it).
The final global parameters go to ``CHECKPOINT_DIR/params.safetensors``.

Snapshots (docs/operations.md, "Snapshots and resume"): every
``checkpoint.every_merges`` merges (or on ``snapshot_now``, e.g. SIGUSR1) the
syncer cuts snapshot S: it writes its state as of this instant, off the event
loop, and every later update carries S; each learner writes its part after
the first such update and reports S in its metadata. Once the syncer's part
and every live learner's are written (or a learner stayed silent for
``2 x liveness_timeout_s``: it resumes like a new learner), the manifest marks
S complete. A syncer started with ``resume`` takes the newest complete
snapshot whose part verifies, as incarnation epoch + 1: learners that never
stopped see the new incarnation in the next update and rejoin.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable

import grpc
from prometheus_client import Counter

from wan_diloco.assemble import Assembly, fragment_digest
from wan_diloco.checkpoint import CheckpointError, SnapshotStore, describe_os_error, save_params
from wan_diloco.config import ConfigError
from wan_diloco.core import Broadcast, ProtocolError, SetTimer, learner_node
from wan_diloco.core.barrier import StartBarrier, barrier_need
from wan_diloco.core.recovery import AskDonor, Candidate, Donations, NoDonor
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.spec import RunSpec
from wan_diloco.transport import Ack, BulkSource, Rejected, TransportMetrics, UpdateHub

log = logging.getLogger(__name__)
Emit = Callable[[dict], None]
LOSS_POINTS = 256  # per learner on /status: the whole run's curve, thinned as it grows (``LossCurve``)
EVENTS = 200  # learners joined, lost, rejoined and warnings on /status (merges are in ``history``)


class ResumeError(RuntimeError):
    """``--resume`` found no snapshot to resume from; the text says where it looked and why."""


class ForkRefused(RuntimeError):
    """A syncer started without ``--resume`` over a checkpoint.dir that holds snapshots: it would start the
    run's model again from scratch beside (and over) the one those snapshots hold."""


@dataclasses.dataclass
class _Incoming:
    """A donor's state arriving in parts (``serde.Donation``)."""

    donor: int
    digest: str
    total_bytes: int
    received: int = 0
    data: bytearray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.data = bytearray(self.total_bytes)


class SyncerService:
    """The transport ``Handler`` of a syncer (see the module docstring)."""

    def __init__(self, cfg: RunSpec, metrics: TransportMetrics, parts: Assembly | None = None,
                 resume: bool = False, shard: int = 0):
        self.cfg, self.metrics = cfg, metrics
        self.shard, self.S = shard, cfg.syncer.shards
        if not (isinstance(shard, int) and 0 <= shard < self.S):
            raise ConfigError(f"shard: must be in 0..{self.S - 1} (syncer.shards = {self.S}), got {shard!r}")
        if self.S > 1 and not cfg.run.run_id:
            raise ConfigError("run.run_id: syncer.shards > 1 needs one run id set in the config (every shard "
                              "must serve the same run; `launch` sets one)")
        parts = parts or Assembly(cfg)
        self.layout, self.codec, self.bulk_codec = parts.layout, parts.codec, parts.bulk_codec
        self.plan = parts.shard_plan
        self.core = parts.syncer_core(bounded=True, shard=shard if self.S > 1 else None)
        self.core.fingerprint = parts.fingerprint  # a learner with other settings is refused at its hello
        self.hub = UpdateHub(cfg.transport.chunk_bytes)
        self.M, self.P = cfg.run.learners, len(self.layout.fragments)
        self.started_s = time.monotonic()
        self.regions: dict[int, str] = {}
        self.streams: dict[int, int] = {}
        self.rejected = 0
        self.resyncs_served = 0
        self._timers: dict[tuple[int, int], asyncio.TimerHandle] = {}
        self.final_fetched: dict[int, set[int]] = {}
        self.final_done = asyncio.Event()
        self.finished = asyncio.Event()
        self.final_report: dict | None = None
        self.late_final: set[int] = set()
        self.stopping = False
        self.final_streams = 0  # final fragments being streamed right now
        self.peer_links: dict[str, dict] = {}  # the transport server's: each learner's last link measurement
        # Shard 0 keeps the snapshots the learners write their parts into; the others keep their own
        # Θ and outer state beside them, one folder each, and resume from it alone.
        root = Path(cfg.checkpoint.dir) / f"shard-{shard}" if shard else cfg.checkpoint.dir
        self.store = SnapshotStore(root) if cfg.checkpoint.dir else None
        self.snap_pending: dict[int, dict] = {}  # snapshot -> {"learners": waited for, "syncer": written?, ...}
        self.snap_merges = 0  # merges at the last cut
        self.snapshots_complete: list[int] = []
        self.params_path: Path | None = None
        self.resumed: dict | None = None  # what a resume took up (snapshot, epoch, snapshots skipped)
        self.donations = Donations(cfg.syncer.donor_timeout_s)
        # recipient -> (digest, the state its donor sent), or why there is none; kept until the recipient
        # took it up (its next metadata no longer recovering), so a broken fetch resumes where it stopped
        self.donated: dict[int, tuple[str, bytearray] | str] = {}
        self.incoming: dict[int, _Incoming] = {}  # recipient -> the state arriving in parts
        self.max_state_bytes = serde.max_state_bytes(sum(self.layout.nbytes))
        self.donated_ready: dict[int, asyncio.Event] = {}
        self.positions: dict[int, str] = {}  # learner -> its data position as of its latest metadata
        self.progress: dict[int, dict] = {}  # learner -> its latest loss and tokens/s (``_on_progress``)
        self.loss_history: dict[int, LossCurve] = {}  # learner -> its loss curve (the dashboard's)
        self.events: collections.deque = collections.deque(maxlen=EVENTS)
        self._liveness: dict[int, bool] = {}  # as of the last event: what ``_note_liveness`` compares with
        self.recovery_bytes = 0
        # Refused learner messages by field (the core counts them; /status["refused"] shows its count).
        self.refused_total = Counter("refused", "Learner messages refused, by the field that was wrong", ["field"],
                                     namespace=metrics.namespace, registry=metrics.registry)
        # Writes that failed (snapshot parts, manifests, the final parameters): /status["storage"].
        self.write_failures = 0
        self.write_error: str | None = None  # the latest failure's; None again after a write succeeds
        self.last_write_error: str | None = None
        self.params_error: str | None = None  # the final parameters could not be written: the run failed
        self.final_saved = asyncio.Event()  # the final parameters are written (or given up on)
        self.process_id = secrets.token_hex(8)  # in each stream's Identity: a restart is told apart
        self.barrier = StartBarrier(barrier_need(cfg.run.min_learners_to_start, self.M), self.M,
                                    cfg.run.start_timeout_s)
        self.failed: str | None = None  # why the run cannot go on (the barrier timed out): the syncer exits non-zero
        if resume:
            self._resume()
        else:
            self._refuse_fork()
            self.core.run_id = cfg.run.run_id or f"run-{secrets.token_hex(6)}"

    # ---- snapshots --------------------------------------------------------------------

    def _resume(self) -> None:
        if self.store is None:
            raise ResumeError("--resume needs checkpoint.dir (where the snapshots are)")
        # Unsharded: an incomplete snapshot whose learner parts are partly there will do (its other learners
        # recover from peers that have theirs). A shard's store holds only its own part: complete ones only.
        found = (self.store.resumable("syncer", "syncer", self.M) if self.S == 1 else
                 self.store.newest("syncer", "syncer"))
        if found is None:
            why = "; ".join(f"snapshot {s}: {e}" for s, e in self.store.skipped) or "no snapshot was ever cut"
            raise ResumeError(f"no snapshot to resume from in {self.store.root}: {why}. Nothing of this run can be "
                              f"taken up: start it again from its config")
        snap, tensors, info, manifest = found
        if self.cfg.run.run_id and info.get("run_id") != self.cfg.run.run_id:
            raise ResumeError(f"snapshot {snap} in {self.store.root} is of run {info.get('run_id')!r}, "
                              f"the config says run.run_id = {self.cfg.run.run_id!r}")
        try:
            self.core.restore(tensors, info)
        except (ValueError, KeyError, TypeError) as e:
            raise ResumeError(f"snapshot {snap} in {self.store.root} does not fit this config: {e}") from None
        self.core.epoch += 1
        self.core.resumed_from = self.core.snapshot_id = snap
        cut = info.get("cut_unix_s")  # learners trained on from the cut until now (absent: an older snapshot)
        age_s = time.time() - cut if isinstance(cut, (int, float)) else self.cfg.syncer.liveness_timeout_s
        self.core.resumed_after(self.now(), age_s)
        self.snap_merges = sum(self.core.stats.fragment_syncs)
        notes = [f"snapshot {s} passed over: {why}" for s, why in self.store.skipped]
        if manifest is None and self.S == 1:
            missing = self.store.missing(snap, self.M)
            have = [n for n in self.store.parts_present(snap) if n.startswith("learner-")]
            if not missing:
                notes.append(f"snapshot {snap} has every part but was not marked complete (the run stopped first)")
            else:
                notes.append(f"snapshot {snap} is incomplete: no part of {', '.join(missing)}; "
                             + (f"they recover from a peer ({', '.join(have)} resume their parts)" if have else
                                "every learner goes on from the global parameters with a fresh inner optimizer"))
        for note in notes:
            log.warning("--resume: %s", note)
        self.resumed = {"snapshot": snap, "epoch": self.core.epoch, "skipped": list(self.store.skipped),
                        "versions": list(self.core.version), "global_step": self.core.global_step,
                        "complete": manifest is not None, "notes": notes}
        # A run that had started stays started: its learners come back to go on, not to wait for each other.
        self.barrier.started = bool(info.get("barrier_started", self.core.global_step > 0))
        positions = info.get("positions")
        if isinstance(positions, dict):
            self.positions = {int(m): pos for m, pos in positions.items()
                              if isinstance(m, str) and m.isdigit() and int(m) < self.M and isinstance(pos, str)
                              and len(pos) <= serde.MAX_STR_CHARS}

    def _refuse_fork(self) -> None:
        """A fresh start over existing snapshots would fork the run: the learners (which keep the run id
        and incarnation 1) would feed fresh parameters, and the final file would overwrite the real one."""
        why = self.store.fork_refusal() if self.store is not None else None
        if why is not None:
            raise ForkRefused(why)

    def snapshot_now(self) -> int | None:
        """Cut a snapshot now (its parts are written in the background); returns its id, or None when
        there is nowhere to write or the run is ending."""
        if self.store is None or self.core.final_started:
            return None
        snap = max(self.store.next_id(), self.core.snapshot_id + 1)
        self.core.snapshot_id = snap
        self.snap_merges = sum(self.core.stats.fragment_syncs)
        tensors, info = self.core.export()
        info["cut_unix_s"] = time.time()  # a resume from it allows learners' steps since (core.pace)
        info["barrier_started"] = self.barrier.started
        # Each learner's data position as of its latest metadata: a learner whose own part turns out unusable
        # at a resume takes it from here (``position/M``) instead of reading its shard again from the start.
        info["positions"] = {str(m): pos for m, pos in self.positions.items()}
        # Learners write their parts for shard 0's snapshots only (the others' reach them renumbered). The cut
        # holds the learners that trained: one that never took a step (still joining or compiling) has no
        # state of its own to keep, and waiting for its part would leave every snapshot incomplete.
        waiting = ({m for m, ln in self.core.learners.items() if ln.alive and ln.step > 0}
                   if self.shard == 0 else set())
        self.snap_pending[snap] = {"learners": waiting, "syncer": False, "cut_s": self.now(),
                                   "versions": list(self.core.version), "parts": []}
        asyncio.get_running_loop().create_task(self._write_syncer_part(snap, tensors, info))
        return snap

    async def _write_syncer_part(self, snap: int, tensors: dict, info: dict) -> None:
        try:
            nbytes = await asyncio.to_thread(self.store.save_part, snap, "syncer", tensors, info, "syncer")
        except (OSError, CheckpointError) as e:
            self._write_failed(f"snapshot {snap}: could not write the syncer's part", e)
            self.snap_pending.pop(snap, None)
            return
        self.write_error = None
        pending = self.snap_pending.get(snap)
        if pending is not None:
            pending.update(syncer=True, bytes=nbytes)
            self._check_snapshots()

    def _on_learner_snapshot(self, m: int, snap: int) -> None:
        for s, pending in self.snap_pending.items():
            if s <= snap and m in pending["learners"]:
                pending["learners"].discard(m)
                pending["parts"].append(f"learner-{m}")
        self._check_snapshots()

    def _check_snapshots(self) -> None:
        """Mark complete every pending snapshot whose parts are all written (a learner that died, or
        stayed silent for twice the liveness timeout, is no longer waited for)."""
        if self.stopping:
            return  # learners leave because everything stops: a snapshot missing their parts is worse
        now, alive = self.now(), set(self.core.alive())
        patience = 2 * self.cfg.syncer.liveness_timeout_s
        for snap in sorted(self.snap_pending):
            pending = self.snap_pending[snap]
            if now - pending["cut_s"] > patience:
                pending["learners"].clear()
            pending["learners"] &= alive
            if not pending["syncer"] or pending["learners"]:
                continue
            del self.snap_pending[snap]
            parts = ["syncer", *sorted(pending["parts"])]
            try:
                self.store.mark_complete(snap, {"run_id": self.core.run_id, "epoch": self.core.epoch, "parts": parts,
                                                "versions": pending["versions"],
                                                "learners": self.M})
            except OSError as e:
                self._write_failed(f"snapshot {snap}: could not write its manifest", e)
                continue
            self.snapshots_complete.append(snap)
            removed = self.store.gc(self.cfg.checkpoint.keep)
            emit({"event": "snapshot", "role": "syncer", "snapshot": snap, "parts": parts,
                  "syncer_bytes": pending.get("bytes", 0), "seconds": round(now - pending["cut_s"], 3),
                  "removed": removed})

    # ---- start barrier ----------------------------------------------------------------

    def _barrier_msg(self) -> serde.Barrier:
        st = self.barrier.status()
        return serde.Barrier(st["started"], st["need"], tuple(st["joined"]), tuple(st["waiting_for"]))

    def _on_joined(self, m: int) -> None:
        """Learner ``m``'s first metadata: it holds Θ and is ready to train. Every learner hears who is
        still missing (the live tables show it), and that the run starts once enough have joined."""
        met = self.barrier.on_joined(self.now(), m)
        self.hub.publish(serde.control_to_frame(self._barrier_msg()))
        if met:
            joined = ", ".join(str(j) for j in sorted(self.barrier.joined))
            log.info("start barrier met: learners %s joined (%d needed)", joined, self.barrier.need)
            emit({"event": "barrier", "role": "syncer", **self.barrier.status()})
            self._event("started", None, f"start barrier met: learners {joined} joined")

    def _check_barrier(self) -> None:
        """A barrier not met within run.start_timeout_s fails the run (the serving loop ends, exit 1)."""
        if self.failed is None and self.barrier.expired(self.now()):
            self.failed = self.barrier.failure()
            log.error("%s", self.failed)
            emit({"event": "error", "role": "syncer", "error": self.failed})
            self.finished.set()

    def _write_failed(self, what: str, e: Exception) -> None:
        """A write failed: loud in the log, the events, /status["storage"] and the live table."""
        self.write_failures += 1
        self.write_error = self.last_write_error = f"{what}: {describe_os_error(e)}"
        log.error("%s (%d failed writes so far; free space: %s)", self.write_error, self.write_failures,
                  _free(self.storage_dir()))
        emit({"event": "warning", "role": "syncer", "what": self.write_error, "storage": self.storage()})
        self._event("warning", None, self.write_error)

    def storage_dir(self) -> str | None:
        return str(self.store.root) if self.store is not None else None

    def storage(self) -> dict:
        """/status["storage"]: where snapshots and the final parameters go, and whether writing works."""
        where = self.storage_dir()
        return {"dir": where, "ok": self.write_error is None and self.params_error is None,
                "failures": self.write_failures, "last_error": self.last_write_error,
                "free_bytes": _free_bytes(where)}

    def _maybe_snapshot(self) -> None:
        every = self.cfg.checkpoint.every_merges
        if every and sum(self.core.stats.fragment_syncs) - self.snap_merges >= every:
            self.snapshot_now()

    # ---- peer recovery ------------------------------------------------------------------

    def _candidates(self) -> dict[int, Candidate]:
        """Learners that can donate: alive, trained at least a step, not recovering themselves."""
        now = self.now()
        out = {}
        for m, info in self.core.learners.items():
            quarantined = self.core.quarantined.get(m, (0.0, ""))[0] > now
            if info.alive and info.step > 0 and not quarantined and m not in self.donations.pending:
                out[m] = Candidate(self.regions.get(m, self.cfg.region(m)), info.step)
        return out

    def _regions_of(self) -> dict[int, str]:
        return {m: self.regions.get(m, self.cfg.region(m)) for m in range(self.M)}

    def _donation_act(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, AskDonor):
                self.hub.publish(serde.control_to_frame(serde.Donate(a.recipient, a.versions)),
                                 to=[learner_node(a.donor)])
                log.info("learner %d recovers from learner %d", a.recipient, a.donor)
            elif isinstance(a, NoDonor):
                self._donation_done(a.recipient, a.why)

    def _donation_done(self, recipient: int, state: bytes | str) -> None:
        self.donated[recipient] = state
        self.donated_ready.setdefault(recipient, asyncio.Event()).set()

    def _on_donation(self, donor: int, msg: serde.Donation, payload) -> Ack:
        """One part of a donor's state; the last one completes it (checked against its digest)."""
        r = msg.recipient
        if self.donations.donor_of(r) != donor:
            raise Rejected(f"learner {donor} was not asked for a state for learner {r} (or was replaced)")
        if msg.total_bytes > self.max_state_bytes:
            raise self._reject(ProtocolError(
                f"Donation: a state of {msg.total_bytes} bytes is larger than this model's state can be "
                f"({self.max_state_bytes} bytes)"))
        got = self.incoming.get(r)
        if got is None or (got.donor, got.digest, got.total_bytes) != (donor, msg.digest, msg.total_bytes):
            if msg.offset:
                raise Rejected(f"Donation: a part at offset {msg.offset} of a state whose first part never arrived "
                               f"(send it again from offset 0)", grpc.StatusCode.FAILED_PRECONDITION)
            got = self.incoming[r] = _Incoming(donor, msg.digest, msg.total_bytes)
        if msg.offset > got.received:
            raise Rejected(f"Donation: a part at offset {msg.offset}, but only {got.received} bytes arrived so far",
                           grpc.StatusCode.FAILED_PRECONDITION)
        got.data[msg.offset : msg.offset + len(payload)] = payload  # a part sent again lands on itself
        got.received = max(got.received, msg.offset + len(payload))
        self.recovery_bytes += len(payload)
        self.donations.progress(self.now(), r)
        if got.received < got.total_bytes:
            return Ack(sender="syncer", global_step=self.core.global_step, detail="donation part")
        del self.incoming[r]
        if serde.bytes_digest(got.data) != got.digest:
            # Never handed on; the donor is replaced when its time is up.
            raise self._reject(ProtocolError(f"Donation: the state for learner {r} does not match its digest"))
        self.donations.delivered(r, donor)
        self._donation_done(r, (got.digest, got.data))
        return Ack(sender="syncer", global_step=self.core.global_step, detail="donation")

    async def _donation_source(self, recipient: int) -> BulkSource:
        """The state donated for ``recipient``, once it is there. Each call waits at most half a call
        timeout (within any client's deadline) and then answers UNAVAILABLE while a donor is still at
        work, so the recipient asks again rather than hitting DEADLINE_EXCEEDED on a slow donor."""
        ready = self.donated_ready.setdefault(recipient, asyncio.Event())
        try:
            await asyncio.wait_for(ready.wait(), self.cfg.transport.call_timeout_s / 2)
        except asyncio.TimeoutError:
            if recipient in self.donations.pending:
                got = self.incoming.get(recipient)
                arrived = f"{got.received} of {got.total_bytes} bytes" if got else "no part yet"
                raise Rejected(f"peer state still arriving ({arrived}): ask again", grpc.StatusCode.UNAVAILABLE) from None
            raise Rejected("no peer state arrived in time", grpc.StatusCode.UNAVAILABLE) from None
        state = self.donated.get(recipient)
        if state is None or self.donated_ready.get(recipient) is not ready:
            raise Rejected("superseded by a newer recovery request", grpc.StatusCode.UNAVAILABLE)
        if isinstance(state, str):
            raise Rejected(f"no peer state: {state}", grpc.StatusCode.NOT_FOUND)
        digest, data = state
        return BulkSource(len(data), [memoryview(data)], etag=digest)

    def _donation_taken(self, recipient: int) -> None:
        """``recipient`` took its state up or went away: the copy kept for a resumed fetch goes."""
        self.donated.pop(recipient, None)
        self.donated_ready.pop(recipient, None)
        self.incoming.pop(recipient, None)

    def _log_notices(self) -> None:
        while self.core.notices:
            what = self.core.notices.popleft()
            log.warning("%s", what)
            emit({"event": "warning", "role": "syncer", "what": what})
            self._event("warning", None, what)

    # ---- plumbing -------------------------------------------------------------------

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def _act(self, actions: list) -> None:
        self._log_notices()
        self._note_liveness()
        for a in actions:
            if isinstance(a, Broadcast):
                self.hub.publish(serde.to_frame(a.msg))
            elif isinstance(a, SetTimer):
                delay = max(0.0, a.at_s - self.now())
                self._timers[a.key] = asyncio.get_running_loop().call_later(delay, self._on_timer, a.key)
        if self.core.final_done and not self.final_done.is_set():
            self._final_done()
        elif actions:
            self._maybe_snapshot()

    def _on_timer(self, key: tuple[int, int]) -> None:
        self._timers.pop(key, None)
        self._act(self.core.on_timer(self.now(), key))

    def tick(self) -> None:
        self.barrier.open(self.now())
        self._check_barrier()
        self._act(self.core.tick(self.now()))
        if self.donations.pending:
            self._donation_act(self.donations.tick(self.now(), self._candidates(), self._regions_of()))
        if self.snap_pending:
            self._check_snapshots()
        self._check_finished()

    def _reject(self, e: Exception) -> Rejected:
        self.rejected += 1
        return Rejected(str(e), grpc.StatusCode.INVALID_ARGUMENT)

    def _refuse(self, e: ProtocolError, frame=None) -> Rejected:
        """A learner message refused: counted by field (on /metrics and /status), logged rate-limited
        by the core. ``frame``: one that did not decode, counted here against its sender's credential."""
        field = e.field or _decoded_field(str(e))
        if frame is not None:
            try:
                m = serde.learner_id(frame.sender, self.M)
            except ProtocolError:
                m = None
            self.core.refused(self.now(), m, ProtocolError(str(e), field))
        self.refused_total.labels(field).inc()
        self._log_notices()
        return self._reject(e)

    # ---- Handler --------------------------------------------------------------------

    async def on_metadata(self, frame) -> Ack:
        meta, refused_before = None, True
        try:
            meta = serde.metadata_from_frame(frame, self.M)
            refused_before = meta.learner in self.core.settings_refused
        except ProtocolError as e:
            raise self._refuse(e, frame) from None
        try:
            self._act(self.core.on_metadata(self.now(), meta))
        except ProtocolError as e:
            # Said once per learner, not at every metadata it sends before it stops.
            if not refused_before and meta.learner in self.core.settings_refused:
                log.error("%s", e)
                emit({"event": "warning", "role": "syncer", "what": str(e)})
                self._event("warning", meta.learner, str(e))
            raise self._refuse(e) from None
        self.regions[meta.learner] = meta.region
        if meta.learner not in self.barrier.joined:
            self._on_joined(meta.learner)
        self._on_progress(meta)
        if meta.data:
            self.positions[meta.learner] = meta.data
        if meta.snapshot and self.snap_pending and meta.epoch == self.core.epoch:
            self._on_learner_snapshot(meta.learner, meta.snapshot)
        if not meta.recovering and meta.learner in self.donated:
            self._donation_taken(meta.learner)
        if meta.recovering and self.shard == 0 and meta.learner not in self.donations.pending:
            # What an earlier attempt left goes; the event stays the same object: the recipient's fetch may
            # have arrived before this metadata (both are sent at once) and be waiting on it already.
            self.donated.pop(meta.learner, None)
            self.incoming.pop(meta.learner, None)
            self.donated_ready.setdefault(meta.learner, asyncio.Event()).clear()
            self._donation_act(self.donations.request(self.now(), meta.learner, tuple(self.core.version),
                                                      self._candidates(), self._regions_of()[meta.learner]))
        return Ack(sender="syncer", global_step=self.core.global_step)

    async def on_fragment(self, frame) -> Ack:
        try:
            donation = serde.donation_from_frame(frame, self.M)
            up = serde.upload_from_frame(frame, self.codec, self.M) if donation is None else None
        except ProtocolError as e:
            raise self._refuse(e, frame) from None
        if donation is not None:
            try:
                return self._on_donation(*donation, frame.payload)
            except ProtocolError as e:
                raise self._refuse(e, frame) from None
        self.regions[up.learner] = up.region
        if up.final and self.core.final_done:
            self.late_final.add(up.learner)  # it still gets the final fragments: wait for its fetch
            return Ack(sender="syncer", global_step=self.core.global_step, detail="late: final sync already done")
        try:
            # A retried upload whose first try got through is a duplicate: the core ignores it.
            self._act(self.core.on_fragment(self.now(), up))
        except ProtocolError as e:
            raise self._refuse(e) from None
        detail = "final" if up.final else f"v{self.core.version[up.fragment]}"
        return Ack(sender="syncer", global_step=self.core.global_step, detail=detail)

    def subscribe(self, msg):
        try:
            m = serde.learner_id(msg.sender, self.M)
        except ProtocolError as e:
            raise self._reject(e) from None
        self.regions[m] = msg.region
        return self._watch(m, self.hub.stream(msg.sender))

    async def _watch(self, m: int, stream):
        self.streams[m] = self.streams.get(m, 0) + 1
        superseded = False
        try:
            yield serde.control_to_frame(serde.Identity(self.core.run_id, self.core.epoch, self.core.resumed_from,
                                                           self.process_id))
            yield serde.control_to_frame(self._barrier_msg())
            async for item in stream:
                yield item
            superseded = True  # a newer subscription of the same learner took over
        finally:
            self.streams[m] -= 1
            if not superseded and not self.stopping and self.streams[m] == 0:
                log.info("learner %d: subscribe stream ended, treating it as lost", m)
                self._act(self.core.on_peer_lost(self.now(), m))
                self._donation_taken(m)
                self._donation_act(self.donations.peer_lost(self.now(), m, self._candidates(), self._regions_of()))

    async def bulk(self, request) -> BulkSource:
        kind, _, index = request.name.partition("/")
        if kind in ("donation", "position") and self.shard:
            raise self._reject(ProtocolError(f"{request.name}: peer recovery is served by syncer shard 0, "
                                             f"this is shard {self.shard}"))
        if kind in ("donation", "position") and index.isascii() and index.isdigit() and int(index) < self.M \
                and index == str(int(index)):
            m = int(index)
            if request.sender != learner_node(m):
                raise self._reject(ProtocolError(f"{request.name} is for learner-{m}, not {request.sender[:40]!r}"))
            if kind == "position":
                data = self.positions.get(m, "").encode()
                return BulkSource(len(data), [data])
            return await self._donation_source(m)
        if kind not in ("fragment", "final") or not (index.isascii() and index.isdigit()) or not 0 <= int(index) < self.P:
            raise self._reject(ProtocolError(
                f"unknown bulk object {request.name!r}; expected fragment/P or final/P with P in 0..{self.P - 1}, "
                f"or donation/M or position/M"))
        p = int(index)
        if not self.core.owns(p):
            raise self._reject(ProtocolError(f"{request.name}: fragment {p} is served by syncer shard "
                                             f"{self.plan[p]}, this is shard {self.shard}"))
        if kind == "final":
            try:
                await asyncio.wait_for(self.final_done.wait(), self.cfg.syncer.final_timeout_s)
            except asyncio.TimeoutError:
                raise Rejected("final sync not done yet", grpc.StatusCode.UNAVAILABLE) from None
        else:
            self.resyncs_served += 1
        data = serde.fragment_to_bulk(p, self.core.version[p], self.core.global_step, self.core.theta[p],
                                      self.bulk_codec, self.core.run_id, self.core.epoch, self.core.resumed_from)
        etag = serde.bytes_digest(data)
        if kind == "final":
            return BulkSource(len(data), self._final_pieces(request.sender, p, data), etag=etag)
        return BulkSource(len(data), [data], etag=etag)

    async def _final_pieces(self, sender: str, p: int, data: bytes):
        self.final_streams += 1
        try:
            yield data
        finally:
            self.final_streams -= 1
        # Only now has the transport taken the last byte (on a slow link, long after bulk() returned):
        # the syncer may end once every learner's final fragments are out, not when they were asked for.
        try:
            m = serde.learner_id(sender, self.M)
            self.final_fetched.setdefault(m, set()).add(p)
        except ProtocolError:
            pass
        self._check_finished()

    # ---- end of run -----------------------------------------------------------------

    async def final_streams_done(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no final fragment is still being streamed."""
        deadline = time.monotonic() + timeout_s
        while self.final_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _final_done(self) -> None:
        """The core merged the final uploads: serve ``final/P`` and report."""
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        self.final_done.set()
        digests = [fragment_digest(self.core.theta[p], self.layout.fragments[p]) if self.core.owns(p) else None
                   for p in range(self.P)]
        if self.store is None:
            self._report_final(digests)
            return
        # A shard writes its fragments' tensors; `launch` joins the shards' files into one.
        self.params_path = (self.store.params_path if self.S == 1 else
                            Path(self.cfg.checkpoint.dir) / f"params.shard-{self.shard}.safetensors")
        info = {"run_id": self.core.run_id, "epoch": self.core.epoch, "versions": list(self.core.version),
                "global_step": self.core.global_step, "digests": digests, "preset": self.cfg.preset,
                "shard": self.shard, "shards": self.S, "owned": list(self.core.owned),
                "model": dataclasses.asdict(self.cfg.model)}
        asyncio.get_running_loop().create_task(self._save_final(self.core.global_params(), info, digests))

    async def _save_final(self, params, info: dict, digests: list) -> None:
        """Write the final parameters; a failure (a full disk) is tried again with backoff for
        ``checkpoint.final_write_retry_s``, then the run has failed (``params_error``). The learners
        fetch their final fragments meanwhile; the syncer ends only after this."""
        retry_s = self.cfg.checkpoint.final_write_retry_s
        deadline, wait_s, tries = self.now() + retry_s, 1.0, 0
        while True:
            tries += 1
            try:
                await asyncio.to_thread(save_params, self.params_path, params, info)
                self.write_error = None
                break
            except (OSError, CheckpointError) as e:
                self._write_failed(f"could not write the final parameters to {self.params_path}", e)
                left = deadline - self.now()
                if left <= 0:
                    self.params_error = (f"{self.write_error} (gave up after {tries} tries over {retry_s:g} s, "
                                         f"checkpoint.final_write_retry_s)")
                    self.params_path = None
                    break
                log.error("trying the final parameters again in %.0f s (for %.0f s more): free some space in %s",
                          min(wait_s, left), left, self.params_path.parent)
                await asyncio.sleep(min(wait_s, left))
                wait_s = min(2 * wait_s, 15.0)
        self._report_final(digests)

    def _report_final(self, digests: list) -> None:
        self.final_report = {
            "event": "final", "role": "syncer", "versions": list(self.core.version), "digests": digests,
            "final_learners": sorted(self.core.final_participants()),
            "params_path": str(self.params_path) if self.params_path else None,
            "params_error": self.params_error,
            **self.summary(),
        }
        self.final_saved.set()
        asyncio.get_running_loop().call_later(self.cfg.syncer.final_timeout_s, self.finished.set)
        self._check_finished()

    def _check_finished(self) -> None:
        if not self.final_done.is_set() or not self.final_saved.is_set():
            return
        # Everyone who took part, arrived late, or is still alive gets to fetch the final fragments.
        waiting = self.core.final_participants() | self.late_final | set(self.core.alive())
        if all(len(self.final_fetched.get(m, ())) == len(self.core.owned) for m in waiting):
            self.finished.set()

    # ---- reporting ------------------------------------------------------------------

    def summary(self) -> dict:
        st = self.core.stats
        return {
            "global_step": self.core.global_step, "fragment_syncs": list(st.fragment_syncs),
            "mean_quorum": sum(st.quorum_sizes) / len(st.quorum_sizes) if st.quorum_sizes else 0.0,
            "mean_grace_s": sum(st.grace_s) / len(st.grace_s) if st.grace_s else 0.0,
            "late_dropped": st.late_dropped, "late_carried": st.late_carried, "stale_dropped": st.stale_dropped,
            "bytes_in": self.metrics.total(self.metrics.bytes_in), "bytes_out": self.metrics.total(self.metrics.bytes_out),
            "probe_bytes": self.metrics.total(self.metrics.bytes_out, "Probe"),
            "rejected": self.rejected, "resyncs_served": self.resyncs_served,
            "duplicate_dropped": st.duplicate_dropped, "stale_epoch": st.stale_epoch, "quarantines": st.quarantines,
            "refused_rounds": st.refused_rounds, "run_id": self.core.run_id, "epoch": self.core.epoch,
            "resumed_from": self.core.resumed_from, "snapshots_complete": len(self.snapshots_complete),
            "recoveries_served": self.donations.served, "donors_replaced": self.donations.replaced,
            "recovery_bytes": self.recovery_bytes,
            "refused": dict(self.core.refusals.by_field),  # learner messages refused, by field (core.refusals)
            "last_snapshot": self.snapshots_complete[-1] if self.snapshots_complete else None,
            "storage": self.storage(),
        }

    def status(self) -> dict:
        """The /status page: learners, regions, versions per fragment, quorum sizes, grace, bytes."""
        now = self.now()
        learners = {}
        for m in range(self.M):
            info = self.core.learners.get(m)
            learners[str(m)] = {
                "region": self.regions.get(m, self.cfg.region(m)),
                "alive": info.alive if info else None,
                "state": self.core.learner_state(m),  # waiting (never heard from), alive, lost or quarantined
                "last_seen_s_ago": round(now - info.last_seen_s, 3) if info else None,
                "step": info.step if info else 0,
                "step_s": info.step_s if info else None,
                "sync_s": info.sync_s if info else None,
                "streams": self.streams.get(m, 0),
                "loss": self.progress.get(m, {}).get("loss"),
                "tokens_per_s": self.progress.get(m, {}).get("tokens_per_s"),
            }
        st = self.core.stats
        history = [{"closed_s": round(t - self.started_s, 3), "fragment": p, "due_step": d, "contributors": list(c)}
                   for t, p, d, c in list(st.history)[-100:]]
        return {
            "uptime_s": round(now - self.started_s, 3), "learners": learners,
            "regions": list(self.cfg.regions.names), "versions": list(self.core.version),
            # Connected and alive: a learner never heard from is "waiting" (learners[m]["state"]), not alive.
            "quorum": self.core.quorum(), "alive": self.core.connected(),
            "quorum_sizes": list(st.quorum_sizes)[-100:], "grace_s": list(st.grace_s)[-100:],
            "grace_window_s": self.core.grace_window_s(), "history": history,
            "fragment_bytes": list(self.layout.nbytes), "final_done": self.final_done.is_set(),
            "links": {sender: {"rtt_ms": v["rtt_ms"], "rate_gbit_s": v["rate_gbit_s"],
                               "age_s": round(now - v["at_s"], 3)} for sender, v in self.peer_links.items()},
            "loss_history": {str(m): curve.points() for m, curve in self.loss_history.items()},
            "events": list(self.events), "shard": self.shard, "shards": self.S, "owned": list(self.core.owned),
            "barrier": self.barrier.status(),
            **self.summary(),
        }

    def _on_progress(self, meta) -> None:
        """A learner's loss and tokens/s, as its metadata reports them (what /metrics shows)."""
        now, m = self.now(), meta.learner
        prev = self.progress.get(m)
        rate = None
        if prev is not None and meta.tokens >= prev["tokens"] and now - prev["t"] >= 1.0:
            rate = (meta.tokens - prev["tokens"]) / (now - prev["t"])
        elif prev is not None and meta.tokens >= prev["tokens"]:
            return  # less than a second since the last reading: keep its window
        self.progress[m] = {"t": now, "tokens": meta.tokens, "loss": meta.loss,
                            "tokens_per_s": rate if rate is not None else (prev or {}).get("tokens_per_s")}
        if meta.loss is not None:
            self.loss_history.setdefault(m, LossCurve()).add([meta.step, meta.loss, round(now - self.started_s, 3)])

    def _event(self, kind: str, learner: int | None, what: str) -> None:
        self.events.append({"at_s": round(self.now() - self.started_s, 3), "kind": kind,
                            "learner": learner, "what": what})

    def _note_liveness(self) -> None:
        """Turn the core's liveness changes into events: the core keeps only the current state."""
        for m, info in self.core.learners.items():
            was = self._liveness.get(m)
            if was == info.alive:
                continue
            self._liveness[m] = info.alive
            if not info.alive:
                self._event("lost", m, f"learner {m} lost")
            else:
                kind = "joined" if was is None else "rejoined"
                self._event(kind, m, f"learner {m} {kind} ({self.regions.get(m) or self.cfg.region(m)})")

    def refresh_gauges(self) -> None:
        g = self.metrics.gauge("fragment_version", "Global version of each fragment", ["fragment"])
        for p, v in enumerate(self.core.version):
            g.labels(str(p)).set(v)
        self.metrics.gauge("learners_alive", "Learners not known to be down").set(len(self.core.alive()))
        self.metrics.gauge("learners_connected", "Learners heard from and alive (not waiting, lost or quarantined)").set(
            len(self.core.connected()))
        self.metrics.gauge("global_step", "Highest learner step seen").set(self.core.global_step)
        sizes = self.core.stats.quorum_sizes
        self.metrics.gauge("last_quorum", "Learners merged in the latest round").set(sizes[-1] if sizes else 0)
        self.metrics.gauge("mean_quorum", "Mean learners merged per round").set(sum(sizes) / len(sizes) if sizes else 0)
        loss = self.metrics.gauge("learner_loss", "Latest training loss each learner reported", ["learner"])
        rate = self.metrics.gauge("learner_tokens_per_s", "Tokens a second each learner trains", ["learner"])
        alive, total = set(self.core.alive()), 0.0
        for m, p in self.progress.items():
            if p["loss"] is not None:
                loss.labels(str(m)).set(p["loss"])
            if p["tokens_per_s"] is not None:
                rate.labels(str(m)).set(p["tokens_per_s"] if m in alive else 0.0)
                total += p["tokens_per_s"] if m in alive else 0.0
        self.metrics.gauge("tokens_per_s", "Tokens a second all live learners train").set(total)
        if self.store is not None:  # failing writes lose snapshots or the result: alert on them
            self.metrics.gauge("checkpoint_write_failures", "Snapshot and final-parameter writes that failed"
                               ).set(self.write_failures)
            self.metrics.gauge("checkpoint_ok", "1 while the latest checkpoint write succeeded").set(
                0 if self.write_error is not None or self.params_error is not None else 1)


def _free_bytes(where: str | None) -> int | None:
    """Free bytes on the file system of ``where`` (or of its nearest existing parent); None if unknown."""
    if not where:
        return None
    path = Path(where).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _free(where: str | None) -> str:
    free = _free_bytes(where)
    return "unknown" if free is None else f"{free / 2**20:.0f} MiB"


def _decoded_field(text: str) -> str:
    """The field of a frame that did not decode, from serde's "Metadata.step: ..." (else "frame")."""
    found = re.match(r"(Metadata|FragmentUpload|Donation)\.(\w+)", text)
    if found is None:
        return "frame"
    kind = {"Metadata": "metadata", "FragmentUpload": "upload", "Donation": "donation"}[found.group(1)]
    return f"{kind}.{found.group(2)}"


class LossCurve:
    """A learner's [step, loss, uptime_s] readings, at most ``cap`` (+ the latest) of them.

    When full, every other point goes and from then on only every other reading is kept: the
    points stay evenly spread over the whole run, however long, and memory stays bounded.
    """

    def __init__(self, cap: int = LOSS_POINTS):
        self.cap, self.stride, self.seen = cap, 1, 0
        self.kept: list[list] = []
        self.latest: list | None = None

    def add(self, point: list) -> None:
        self.latest = point
        if self.seen % self.stride == 0:
            self.kept.append(point)
            if len(self.kept) > self.cap:
                del self.kept[1::2]
                self.stride *= 2
        self.seen += 1

    def points(self) -> list[list]:
        """What /status shows: the kept points, and the latest reading so the curve ends at now."""
        if self.kept and self.kept[-1] is self.latest:
            return list(self.kept)
        return self.kept + [self.latest]
