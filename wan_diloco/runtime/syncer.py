"""The syncer service: ``SyncerCore`` behind the transport's ``Handler``, on one asyncio loop.

Every event is handled on the loop thread (the core is not thread-safe);
timers come from ``SetTimer`` via ``loop.call_later``, liveness from a periodic
``tick`` and from subscribe streams that end. Broadcasts go through the
transport's drop-to-latest fan-out; a learner that missed versions fetches the
full fragment by bulk (``fragment/P``), as does a learner that (re)joins.

End of run: learners upload every fragment flagged ``final``; the core merges
them once every live learner has (or ``syncer.final_timeout_s`` after the
first), and the final fragments are served as ``final/P`` (a fetch waits for it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from wan_diloco.assemble import Assembly, fragment_digest
from wan_diloco.core import Broadcast, ProtocolError, SetTimer
from wan_diloco.runtime import serde
from wan_diloco.spec import RunSpec
from wan_diloco.transport import Ack, BulkSource, Rejected, TransportMetrics, UpdateHub

log = logging.getLogger(__name__)
Emit = Callable[[dict], None]


class SyncerService:
    """The transport ``Handler`` of a syncer (see the module docstring)."""

    def __init__(self, cfg: RunSpec, metrics: TransportMetrics, parts: Assembly | None = None):
        self.cfg, self.metrics = cfg, metrics
        parts = parts or Assembly(cfg)
        self.layout, self.codec, self.bulk_codec = parts.layout, parts.codec, parts.bulk_codec
        self.core = parts.syncer_core(bounded=True)
        # Compiling on the first merge would stall the event loop while uploads and metadata wait.
        self.core.warm_up()
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

    # ---- plumbing -------------------------------------------------------------------

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def _act(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Broadcast):
                self.hub.publish(serde.to_frame(a.msg))
            elif isinstance(a, SetTimer):
                delay = max(0.0, a.at_s - self.now())
                self._timers[a.key] = asyncio.get_running_loop().call_later(delay, self._on_timer, a.key)
        if self.core.final_done and not self.final_done.is_set():
            self._final_done()

    def _on_timer(self, key: tuple[int, int]) -> None:
        self._timers.pop(key, None)
        self._act(self.core.on_timer(self.now(), key))

    def tick(self) -> None:
        self._act(self.core.tick(self.now()))
        self._check_finished()

    def _reject(self, e: Exception) -> Rejected:
        self.rejected += 1
        return Rejected(str(e), grpc.StatusCode.INVALID_ARGUMENT)

    # ---- Handler --------------------------------------------------------------------

    async def on_metadata(self, frame) -> Ack:
        try:
            meta = serde.metadata_from_frame(frame, self.M)
            self._act(self.core.on_metadata(self.now(), meta))
        except ProtocolError as e:
            raise self._reject(e) from None
        self.regions[meta.learner] = meta.region
        return Ack(sender="syncer", global_step=self.core.global_step)

    async def on_fragment(self, frame) -> Ack:
        try:
            up = serde.upload_from_frame(frame, self.codec, self.M)
            self.regions[up.learner] = up.region
            if up.final and self.core.final_done:
                self.late_final.add(up.learner)  # it still gets the final fragments: wait for its fetch
                return Ack(sender="syncer", global_step=self.core.global_step, detail="late: final sync already done")
            # A retried upload whose first try got through is a duplicate: the core ignores it.
            self._act(self.core.on_fragment(self.now(), up))
        except ProtocolError as e:
            raise self._reject(e) from None
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
            async for item in stream:
                yield item
            superseded = True  # a newer subscription of the same learner took over
        finally:
            self.streams[m] -= 1
            if not superseded and not self.stopping and self.streams[m] == 0:
                log.info("learner %d: subscribe stream ended, treating it as lost", m)
                self._act(self.core.on_peer_lost(self.now(), m))

    async def bulk(self, request) -> BulkSource:
        kind, _, index = request.name.partition("/")
        if kind not in ("fragment", "final") or not (index.isascii() and index.isdigit()) or not 0 <= int(index) < self.P:
            raise self._reject(ProtocolError(
                f"unknown bulk object {request.name!r}; expected fragment/P or final/P with P in 0..{self.P - 1}"))
        p = int(index)
        if kind == "final":
            try:
                await asyncio.wait_for(self.final_done.wait(), self.cfg.syncer.final_timeout_s)
            except asyncio.TimeoutError:
                raise Rejected("final sync not done yet", grpc.StatusCode.UNAVAILABLE) from None
        else:
            self.resyncs_served += 1
        data = serde.fragment_to_bulk(p, self.core.version[p], self.core.global_step, self.core.theta[p],
                                      self.bulk_codec)
        if kind == "final":
            return BulkSource(len(data), self._final_pieces(request.sender, p, data))
        return BulkSource(len(data), [data])

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
        self.final_report = {
            "event": "final", "role": "syncer", "versions": list(self.core.version),
            "digests": [fragment_digest(self.core.theta[p], self.layout.fragments[p]) for p in range(self.P)],
            "final_learners": sorted(self.core.final_participants()),
            **self.summary(),
        }
        asyncio.get_running_loop().call_later(self.cfg.syncer.final_timeout_s, self.finished.set)
        self._check_finished()

    def _check_finished(self) -> None:
        if not self.final_done.is_set():
            return
        # Everyone who took part, arrived late, or is still alive gets to fetch the final fragments.
        waiting = self.core.final_participants() | self.late_final | set(self.core.alive())
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
            "bytes_in": self.metrics.total(self.metrics.bytes_in), "bytes_out": self.metrics.total(self.metrics.bytes_out),
            "probe_bytes": self.metrics.total(self.metrics.bytes_out, "Probe"),
            "rejected": self.rejected, "resyncs_served": self.resyncs_served,
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
            "regions": list(self.cfg.regions.names), "versions": list(self.core.version),
            "quorum": self.core.quorum(), "alive": self.core.alive(),
            "quorum_sizes": list(st.quorum_sizes)[-100:], "grace_s": list(st.grace_s)[-100:],
            "grace_window_s": self.core.grace_window_s(), "history": history,
            "fragment_bytes": list(self.layout.nbytes), "final_done": self.final_done.is_set(),
            "links": {sender: {"rtt_ms": v["rtt_ms"], "rate_gbit_s": v["rate_gbit_s"],
                               "age_s": round(now - v["at_s"], 3)} for sender, v in self.peer_links.items()},
            **self.summary(),
        }

    def refresh_gauges(self) -> None:
        g = self.metrics.gauge("fragment_version", "Global version of each fragment", ["fragment"])
        for p, v in enumerate(self.core.version):
            g.labels(str(p)).set(v)
        self.metrics.gauge("learners_alive", "Learners not known to be down").set(len(self.core.alive()))
        self.metrics.gauge("global_step", "Highest learner step seen").set(self.core.global_step)

