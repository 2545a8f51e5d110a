"""The syncer service: ``SyncerCore`` behind the transport's ``Handler``, on one asyncio loop.

Every event is handled on the loop thread (the core is not thread-safe);
timers come from ``SetTimer`` via ``loop.call_later``, liveness from a periodic
``tick`` and from subscribe streams that end. Broadcasts go through the
transport's drop-to-latest fan-out; a learner that missed versions fetches the
full fragment by bulk (``fragment/P``), as does a learner that (re)joins.

End of run: learners upload every fragment flagged ``final``; once every live
learner has (or ``final_timeout_s`` after the first one), ``final_sync`` merges
them and the final fragments are served as ``final/P`` (a fetch waits for it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import grpc

from wan_diloco import model as model_lib
from wan_diloco.core import Broadcast, ProtocolError, SetTimer, SyncerCore
from wan_diloco.runtime import wire
from wan_diloco.runtime.config import RuntimeConfig
from wan_diloco.runtime.setup import fragment_digest, host_flat, initial_params, layout_of
from wan_diloco.transport import Ack, BulkSource, Rejected, TransportMetrics, UpdateHub

log = logging.getLogger(__name__)
Emit = Callable[[dict], None]


class SyncerService:
    """The transport ``Handler`` of a syncer (see the module docstring)."""

    def __init__(self, cfg: RuntimeConfig, metrics: TransportMetrics, codec: wire.WireCodec | None = None):
        self.cfg, self.metrics = cfg, metrics
        flat = host_flat(initial_params(cfg))
        self.layout = layout_of(cfg, flat)
        self.codec = codec or wire.make_codec(self.layout, cfg.codec)
        self.core = SyncerCore(cfg.syncer, self.layout.fragments, flat, model_lib.is_embedding, codec=self.codec)
        self._warm_up()
        self.hub = UpdateHub(cfg.transport.chunk_bytes)
        self.M, self.P = cfg.run.learners, len(self.layout.fragments)
        self.started_s = time.monotonic()
        self.timing: dict[int, tuple[float | None, float | None]] = {}  # learner -> (step_s, sync_s)
        self.regions: dict[int, str] = {}
        self.streams: dict[int, int] = {}
        self.rejected = 0
        self.resyncs_served = 0
        self._timers: dict[tuple[int, int], asyncio.TimerHandle] = {}
        self.final_uploads: dict[tuple[int, int], Any] = {}
        self.final_fetched: dict[int, set[int]] = {}
        self.final_done = asyncio.Event()
        self.finished = asyncio.Event()
        self._final_timer: asyncio.TimerHandle | None = None
        self.final_report: dict | None = None
        self.late_final: set[int] = set()
        self.stopping = False

    def _warm_up(self) -> None:
        """Compile the outer step of every fragment now: compiling on the first merge would stall the
        event loop (seconds on a loaded CPU) while uploads and metadata wait behind it."""
        import jax
        import numpy as np

        outer = self.core.outer
        for p, theta in enumerate(self.core.theta):
            zeros = {n: np.zeros_like(a) for n, a in theta.items()}
            jax.block_until_ready(outer._step(dict(theta), zeros, outer.states[p]))  # result discarded

    # ---- plumbing -------------------------------------------------------------------

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def _act(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Broadcast):
                self.hub.publish(wire.update_to_wire(a.msg))
            elif isinstance(a, SetTimer):
                delay = max(0.0, a.at_s - self.now())
                self._timers[a.key] = asyncio.get_running_loop().call_later(delay, self._on_timer, a.key)

    def _on_timer(self, key: tuple[int, int]) -> None:
        self._timers.pop(key, None)
        self._act(self.core.on_timer(self.now(), key))

    def tick(self) -> None:
        self._act(self.core.tick(self.now()))
        self._check_final()
        self._check_finished()

    def _reject(self, e: Exception) -> Rejected:
        self.rejected += 1
        return Rejected(str(e), grpc.StatusCode.INVALID_ARGUMENT)

    # ---- Handler --------------------------------------------------------------------

    async def on_metadata(self, msg) -> Ack:
        try:
            m = wire.learner_id(msg.sender, self.M)
            step_s, sync_s = self.timing.get(m, (None, None))
            meta = wire.metadata_from_wire(msg, self.M, step_s, sync_s)
            self._act(self.core.on_metadata(self.now(), meta))
        except ProtocolError as e:
            raise self._reject(e) from None
        self.regions[m] = msg.region
        return Ack(sender="syncer", global_step=self.core.global_step)

    async def on_fragment(self, msg) -> Ack:
        try:
            up, fields = wire.upload_from_wire(msg, self.codec, self.M)
            if up.due_step < 1:
                raise ProtocolError(f"fragment upload from learner {up.learner}: due_step must be >= 1")
            timing = tuple(v if isinstance(v, (int, float)) else None for v in (fields.get("step_s"), fields.get("sync_s")))
            self.timing[up.learner] = timing  # type: ignore[assignment]
            self.regions[up.learner] = msg.region
            if fields["final"]:
                return self._final_upload(up)
            # A retried upload whose first try got through is a duplicate: the core ignores it.
            self._act(self.core.on_fragment(self.now(), up))
        except ProtocolError as e:
            raise self._reject(e) from None
        return Ack(sender="syncer", global_step=self.core.global_step, detail=f"v{self.core.version[up.fragment]}")

    def subscribe(self, msg):
        try:
            m = wire.learner_id(msg.sender, self.M)
        except ProtocolError as e:
            raise self._reject(e) from None
        self.regions[m] = msg.region
        return self._watch(m, self.hub.stream(msg.sender))

    async def _watch(self, m: int, stream):
        self.streams[m] = self.streams.get(m, 0) + 1
        superseded = False
        try:
            async for item in stream:
                yield item
            superseded = True  # a newer subscription of the same learner took over
        finally:
            self.streams[m] -= 1
            if not superseded and not self.stopping and self.streams[m] == 0:
                log.info("learner %d: subscribe stream ended, treating it as lost", m)
                self._act(self.core.on_peer_lost(self.now(), m))
                self._check_final()

    async def bulk(self, request) -> BulkSource:
        kind, _, index = request.name.partition("/")
        if kind not in ("fragment", "final") or not index.isdigit() or not 0 <= int(index) < self.P:
            raise self._reject(ProtocolError(
                f"unknown bulk object {request.name!r}; expected fragment/P or final/P with P in 0..{self.P - 1}"))
        p = int(index)
        if kind == "final":
            try:
                await asyncio.wait_for(self.final_done.wait(), self.cfg.run.final_timeout_s)
            except asyncio.TimeoutError:
                raise Rejected("final sync not done yet", grpc.StatusCode.UNAVAILABLE) from None
        else:
            self.resyncs_served += 1
        data = wire.fragment_to_bulk(p, self.core.version[p], self.core.theta[p], self.layout, self.core.global_step)
        if kind == "final":
            try:
                m = wire.learner_id(request.sender, self.M)
                self.final_fetched.setdefault(m, set()).add(p)
            except ProtocolError:
                pass
            self._check_finished()
        return BulkSource(len(data), [data])

    # ---- end of run -----------------------------------------------------------------

    def _final_upload(self, up) -> Ack:
        if self.final_done.is_set():
            self.late_final.add(up.learner)  # it still gets the final fragments: wait for its fetch
            return Ack(sender="syncer", global_step=self.core.global_step, detail="late: final sync already done")
        self.final_uploads[(up.learner, up.fragment)] = up  # idempotent: a retry overwrites
        if self._final_timer is None:
            self._final_timer = asyncio.get_running_loop().call_later(self.cfg.run.final_timeout_s, self._run_final)
        self._check_final()
        return Ack(sender="syncer", global_step=self.core.global_step, detail="final")

    def _final_participants(self) -> set[int]:
        return {m for (m, _) in self.final_uploads}

    def _check_final(self) -> None:
        if not self.final_uploads or self.final_done.is_set():
            return
        delivered = {m for m in range(self.M) if all((m, p) in self.final_uploads for p in range(self.P))}
        if set(self.core.alive()) <= delivered:
            self._run_final()

    def _run_final(self) -> None:
        if self.final_done.is_set():
            return
        if self._final_timer is not None:
            self._final_timer.cancel()
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        uploads = list(self.final_uploads.values())
        self._act(self.core.final_sync(self.now(), uploads))
        self.final_done.set()
        self.final_report = {
            "event": "final", "role": "syncer", "versions": list(self.core.version),
            "digests": [fragment_digest(self.core.theta[p], self.layout.fragments[p]) for p in range(self.P)],
            "final_learners": sorted(self._final_participants()),
            **self.summary(),
        }
        asyncio.get_running_loop().call_later(self.cfg.run.final_timeout_s, self.finished.set)
        self._check_finished()

    def _check_finished(self) -> None:
        if not self.final_done.is_set():
            return
        # Everyone who took part, arrived late, or is still alive gets to fetch the final fragments.
        waiting = self._final_participants() | self.late_final | set(self.core.alive())
        if all(len(self.final_fetched.get(m, ())) == self.P for m in waiting):
            self.finished.set()

    # ---- reporting ------------------------------------------------------------------

    def summary(self) -> dict:
        st = self.core.stats
        return {
            "global_step": self.core.global_step, "fragment_syncs": list(st.fragment_syncs),
            "mean_quorum": sum(st.quorum_sizes) / len(st.quorum_sizes) if st.quorum_sizes else 0.0,
            "mean_grace_s": sum(st.grace_s) / len(st.grace_s) if st.grace_s else 0.0,
            "late_dropped": st.late_dropped, "late_carried": st.late_carried, "stale_dropped": st.stale_dropped,
            "bytes_in": _total(self.metrics.bytes_in), "bytes_out": _total(self.metrics.bytes_out),
            "rejected": self.rejected, "resyncs_served": self.resyncs_served,
        }

    def status(self) -> dict:
        """The /status page: learners, regions, versions per fragment, quorum sizes, grace, bytes."""
        now = self.now()
        learners = {}
        for m in range(self.M):
            info = self.core.learners.get(m)
            learners[str(m)] = {
                "region": self.regions.get(m, self.cfg.run.region(m)),
                "alive": info.alive if info else None,
                "last_seen_s_ago": round(now - info.last_seen_s, 3) if info else None,
                "step": info.step if info else 0,
                "step_s": info.step_s if info else None,
                "sync_s": info.sync_s if info else None,
                "streams": self.streams.get(m, 0),
            }
        st = self.core.stats
        history = [{"closed_s": round(t - self.started_s, 3), "fragment": p, "due_step": d, "contributors": list(c)}
                   for t, p, d, c in list(st.history)[-100:]]
        return {
            "uptime_s": round(now - self.started_s, 3), "learners": learners,
            "regions": sorted(set(self.cfg.run.regions)), "versions": list(self.core.version),
            "quorum": self.core._quorum(), "alive": self.core.alive(),
            "quorum_sizes": list(st.quorum_sizes)[-100:], "grace_s": list(st.grace_s)[-100:],
            "grace_window_s": self.core.grace_window_s(), "history": history,
            "fragment_bytes": list(self.layout.nbytes), "final_done": self.final_done.is_set(), **self.summary(),
        }

    def refresh_gauges(self) -> None:
        g = self.metrics.gauge("fragment_version", "Global version of each fragment", ["fragment"])
        for p, v in enumerate(self.core.version):
            g.labels(str(p)).set(v)
        self.metrics.gauge("learners_alive", "Learners not known to be down").set(len(self.core.alive()))
        self.metrics.gauge("global_step", "Highest learner step seen").set(self.core.global_step)


def _total(counter) -> int:
    return int(sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")))
