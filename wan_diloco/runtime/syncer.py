"""The syncer service: the core pieces behind the transport's ``Handler``, on one asyncio loop.

An IO adapter and nothing else: every protocol decision is made by a sans-IO
core piece, which returns actions that ``_act`` carries out through
``core.effects.dispatch_syncer`` (this class is its ``SyncerEffects``): ``SyncerCore`` (rounds, merges, the final sync),
``SnapshotCoordinator`` (cut, parts, completion, resume), ``Donations`` (peer
recovery and its reassembly), ``Positions`` (data positions), ``StartBarrier``,
``core.objects`` (what a bulk request gets, when the run may end) and
``ShardPlan``. This module moves bytes and files, keeps timers and waiters,
and reports (``syncer_status``; the final write is ``syncer_final``).

Every event is handled on the loop thread (the core is not thread-safe);
timers come from ``SetTimer`` via ``loop.call_later``, liveness from a periodic
``tick`` and from subscribe streams that end. Broadcasts go through the
transport's drop-to-latest fan-out; a learner that missed versions fetches the
full fragment by bulk (``fragment/P``), as does a learner that (re)joins.
Snapshots and resume: docs/operations.md, "Snapshots and resume".
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import typing
from pathlib import Path

import grpc
from prometheus_client import Counter

from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.config import ConfigError
from wan_diloco.core import ProtocolError, learner_node
from wan_diloco.core.barrier import StartBarrier, barrier_need
from wan_diloco.core.effects import dispatch_syncer
from wan_diloco.core.objects import FinalSync, ServeDonation, ServeFragment, ServePosition, route
from wan_diloco.core.positions import Positions
from wan_diloco.core.recovery import DonatedState, Donations, PartRefused
from wan_diloco.core.shards import ShardPlan
from wan_diloco.core.snapshots import ForkRefused, ResumeError, SnapshotCoordinator, fork_refusal
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.syncer_final import FinalWrite
from wan_diloco.runtime.syncer_snapshots import SnapshotFiles
from wan_diloco.runtime.syncer_status import LOSS_POINTS, LossCurve, StatusPage
from wan_diloco.spec import RunSpec
from wan_diloco.transport import Ack, BulkSource, Rejected, TransportMetrics, UpdateHub

__all__ = ["ForkRefused", "LOSS_POINTS", "LossCurve", "ResumeError", "SyncerService"]
log = logging.getLogger(__name__)


class SyncerService(StatusPage, FinalWrite, SnapshotFiles):
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
        self.plan = ShardPlan(parts.shard_plan)
        self.core = parts.syncer_core(bounded=True, shard=shard if self.S > 1 else None)
        self.hub = UpdateHub(cfg.transport.chunk_bytes)
        self.M, self.P = cfg.run.learners, len(self.layout.fragments)
        self.started_s = time.monotonic()
        self.regions: dict[int, str] = {}  # learner -> the region it says it is in (else the config's)
        self.streams: dict[int, int] = {}
        self.rejected = self.resyncs_served = 0
        self._timers: dict[tuple[int, int], asyncio.TimerHandle] = {}
        self._stopping = False
        self.peer_links: dict[str, dict] = {}  # the transport server's: each learner's last link measurement
        self.refused_total = Counter("refused", "Learner messages refused, by the field that was wrong", ["field"],
                                     namespace=metrics.namespace, registry=metrics.registry)
        self.process_id = secrets.token_hex(8)  # in each stream's Identity: a restart is told apart
        # Shard 0 keeps the snapshots the learners write their parts into; the others keep their own
        # Θ and outer state beside them, one folder each, and resume from it alone.
        root = Path(cfg.checkpoint.dir) / f"shard-{shard}" if shard else cfg.checkpoint.dir
        self.store = SnapshotStore(root) if cfg.checkpoint.dir else None
        self.barrier = StartBarrier(barrier_need(cfg.run.min_learners_to_start, self.M), self.M,
                                    cfg.run.start_timeout_s)
        self.positions = Positions(self.M, serde.MAX_STR_CHARS)
        self.donations = Donations(cfg.syncer.donor_timeout_s, serde.max_state_bytes(sum(self.layout.nbytes)))
        self.donated_ready: dict[int, asyncio.Event] = {}  # recipient -> wakes its fetch of donation/M
        self.snapshots = SnapshotCoordinator(
            self.core, self.barrier, self.positions, every_merges=cfg.checkpoint.every_merges,
            patience_s=2 * cfg.syncer.liveness_timeout_s, learners=self.M, learner_parts=shard == 0,
            enabled=self.store is not None, first_id=self.store.next_id() if self.store is not None else 1)
        self.final = FinalSync(self.core)
        self._init_status()
        self._init_final()
        self.core.start("" if resume else cfg.run.run_id or f"run-{secrets.token_hex(6)}", parts.fingerprint)
        if resume:
            self._resume()
        elif (why := fork_refusal(resume, self.store.fork_refusal() if self.store is not None else None)):
            raise ForkRefused(why)

    @property
    def resumed(self) -> dict | None:
        """What a resume took up (snapshot, epoch, snapshots skipped, notes); None for a fresh start."""
        return self.snapshots.resumed

    @property
    def failed(self) -> str | None:
        """Why the run cannot go on (the start barrier timed out): the syncer exits non-zero."""
        return self.barrier.failed

    @property
    def stopping(self) -> bool:
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        """From now on learners going away is the shutdown, not a failure: no snapshot completes."""
        self._stopping = value
        if value:
            self.snapshots.stop()

    def region(self, m: int) -> str:
        return self.regions.get(m, self.cfg.region(m))

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # ---- actions ----------------------------------------------------------------------

    def _act(self, actions: list) -> None:
        """Carry out what the core pieces decided through ``dispatch_syncer``; the effects follow (those of
        the snapshot files in ``SnapshotFiles``)."""
        self._log_notices()
        self._note_liveness()
        for a in actions:
            dispatch_syncer(a, self)

    def broadcast(self, msg) -> None:
        self.hub.publish(serde.to_frame(msg))

    def set_timer(self, key: tuple[int, int], at_s: float) -> None:
        self._timers[key] = asyncio.get_running_loop().call_later(max(0.0, at_s - self.now()), self._on_timer, key)

    def send_donate(self, donor: int, recipient: int, versions: tuple[int, ...]) -> None:
        self.hub.publish(serde.control_to_frame(serde.Donate(recipient, versions)), to=[learner_node(donor)])
        log.info("learner %d recovers from learner %d", recipient, donor)

    def answer_state_fetch(self, recipient: int) -> None:
        self.donated_ready.setdefault(recipient, asyncio.Event()).set()

    def refuse_state_fetch(self, recipient: int, why: str) -> None:
        self.answer_state_fetch(recipient)  # the fetch reads why from ``Donations.lookup``

    def hold_state_fetch(self, recipient: int) -> None:  # the same waiter: its fetch may come before this
        self.donated_ready.setdefault(recipient, asyncio.Event()).clear()

    def drop_state(self, recipient: int) -> None:
        self.donated_ready.pop(recipient, None)

    def announce_barrier(self, status: dict, met: bool) -> None:
        self.hub.publish(serde.control_to_frame(self._barrier_msg()))
        if met:
            joined = ", ".join(str(j) for j in status["joined"])
            log.info("start barrier met: learners %s joined (%d needed)", joined, status["need"])
            emit({"event": "barrier", "role": "syncer", **status})
            self._event("started", None, f"start barrier met: learners {joined} joined")

    def announce_snapshot(self, msg) -> None:
        self.hub.publish(serde.control_to_frame(msg))

    def fail(self, why: str) -> None:
        log.error("%s", why)
        emit({"event": "error", "role": "syncer", "error": why})
        self.finished.set()

    def _core(self, actions: list) -> None:
        """After an event of the syncer core: its actions, then the end of the run or a snapshot if due."""
        self._act(actions)
        if self.final.on_merged():
            self._final_merged()
        elif actions:
            self._act(self.snapshots.on_merged(self.now(), time.time()))

    def _barrier_msg(self) -> serde.Barrier:
        st = self.barrier.status()
        return serde.Barrier(st["started"], st["need"], tuple(st["joined"]), tuple(st["waiting_for"]))

    def _candidates(self):
        return self.donations.candidates(self.now(), self.core.learners, self.core.quarantined, self._regions_of())

    def _regions_of(self) -> dict[int, str]:
        return {m: self.region(m) for m in range(self.M)}

    def _log_notices(self) -> None:
        while self.core.notices:
            self._warn(self.core.notices.popleft())

    def _on_timer(self, key: tuple[int, int]) -> None:
        self._timers.pop(key, None)
        self._core(self.core.on_timer(self.now(), key))

    def tick(self) -> None:
        now = self.now()
        self._act(self.barrier.on_tick(now))
        self._core(self.core.tick(now))
        self._act(self.donations.on_tick(now, self._candidates(), self._regions_of()))
        self._act(self.snapshots.check(now))
        if self.final.finished():
            self.finished.set()

    def _reject(self, e: Exception) -> Rejected:
        self.rejected += 1
        return Rejected(str(e), grpc.StatusCode.INVALID_ARGUMENT)

    # ---- Handler --------------------------------------------------------------------

    async def on_metadata(self, frame) -> Ack:
        try:
            meta = serde.metadata_from_frame(frame, self.M)
        except ProtocolError as e:
            raise self._refuse(e, frame) from None
        refused_before = meta.learner in self.core.settings_refused
        try:
            self._core(self.core.on_metadata(self.now(), meta))
        except ProtocolError as e:
            if not refused_before and meta.learner in self.core.settings_refused:  # said once per learner
                log.error("%s", e)
                emit({"event": "warning", "role": "syncer", "what": str(e)})
                self._event("warning", meta.learner, str(e))
            raise self._refuse(e) from None
        now, m = self.now(), meta.learner
        self.regions[m] = meta.region
        self._act(self.barrier.on_metadata(now, m))
        self._on_progress(meta)
        self.positions.on_metadata(now, m, meta.data)
        self._act(self.snapshots.on_metadata(now, m, meta.snapshot, meta.epoch))
        if self.shard == 0 or not meta.recovering:  # peer recovery is shard 0's
            self._act(self.donations.on_metadata(now, m, meta.recovering, tuple(self.core.version),
                                                 self._candidates(), self.region(m)))
        return Ack(sender="syncer", global_step=self.core.global_step)

    async def on_fragment(self, frame) -> Ack:
        try:
            donation = serde.donation_from_frame(frame, self.M)
            up = serde.upload_from_frame(frame, self.codec, self.M) if donation is None else None
        except ProtocolError as e:
            raise self._refuse(e, frame) from None
        if donation is not None:
            donor, msg = donation
            try:
                acts = self.donations.on_part(self.now(), donor, msg.recipient, msg.offset, msg.total_bytes,
                                              msg.digest, frame.payload)
            except PartRefused as e:
                raise Rejected(str(e)) from None
            except ProtocolError as e:
                raise self._refuse(e, frame) from None
            self._act(acts)
            return Ack(sender="syncer", global_step=self.core.global_step,
                       detail="donation" if acts else "donation part")
        self.regions[up.learner] = up.region
        if self.final.on_upload(up.learner, up.final):  # it still gets the final fragments: wait for its fetch
            return Ack(sender="syncer", global_step=self.core.global_step, detail="late: final sync already done")
        try:
            # A retried upload whose first try got through is a duplicate: the core ignores it.
            self._core(self.core.on_fragment(self.now(), up))
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
            if (cut := self.snapshots.announcement()) is not None:  # a learner that reconnects misses no cut
                yield serde.control_to_frame(cut)
            async for item in stream:
                yield item
            superseded = True  # a newer subscription of the same learner took over
        finally:
            self.streams[m] -= 1
            if not superseded and not self.stopping and self.streams[m] == 0:
                log.info("learner %d: subscribe stream ended, treating it as lost", m)
                self._core(self.core.on_peer_lost(self.now(), m))
                self._act(self.donations.on_peer_lost(self.now(), m, self._candidates(), self._regions_of()))

    async def bulk(self, request) -> BulkSource:
        try:
            served = route(request.name, request.sender, plan=self.plan, shard=self.shard, num_learners=self.M,
                           position_of=self.positions.of)
        except ProtocolError as e:
            raise self._reject(e) from None
        match served:
            case ServePosition(data=data):
                return BulkSource(len(data), [data])
            case ServeDonation(learner=m):
                return await self._donation_source(m)
            case ServeFragment(fragment=p, final=final):
                return await self._fragment_source(request.sender, p, final)
            case _:
                typing.assert_never(served)

    async def _fragment_source(self, sender: str, p: int, final: bool) -> BulkSource:
        if final:
            try:
                await asyncio.wait_for(self.final_done.wait(), self.cfg.syncer.final_timeout_s)
            except asyncio.TimeoutError:
                raise Rejected("final sync not done yet", grpc.StatusCode.UNAVAILABLE) from None
        else:
            self.resyncs_served += 1
        data = serde.fragment_to_bulk(p, self.core.version[p], self.core.global_step, self.core.theta[p],
                                      self.bulk_codec, self.core.run_id, self.core.epoch, self.core.resumed_from)
        etag = serde.bytes_digest(data)
        if final:
            return BulkSource(len(data), self._final_pieces(sender, p, data), etag=etag)
        return BulkSource(len(data), [data], etag=etag)

    async def _donation_source(self, recipient: int) -> BulkSource:
        """The state donated for ``recipient``, once it is there. Each call waits at most half a call
        timeout (within any client's deadline) and then answers UNAVAILABLE while a donor is still at
        work, so the recipient asks again rather than hitting DEADLINE_EXCEEDED on a slow donor."""
        ready = self.donated_ready.setdefault(recipient, asyncio.Event())
        try:
            await asyncio.wait_for(ready.wait(), self.cfg.transport.call_timeout_s / 2)
        except asyncio.TimeoutError:
            raise Rejected(self.donations.not_yet(recipient).why, grpc.StatusCode.UNAVAILABLE) from None
        got = self.donations.lookup(recipient) if self.donated_ready.get(recipient) is ready else None
        if got is None:
            raise Rejected("superseded by a newer recovery request", grpc.StatusCode.UNAVAILABLE)
        if not isinstance(got, DonatedState):
            raise Rejected(got.why, grpc.StatusCode.NOT_FOUND)
        return BulkSource(len(got.data), [memoryview(got.data)], etag=got.digest)

