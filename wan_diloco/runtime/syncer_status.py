"""What the syncer reports: /status, the run summary, /metrics gauges, its events and storage health.

``StatusPage`` is the reporting side of ``runtime.syncer.SyncerService``, kept
apart so that the service is the IO adapter of the core pieces and nothing else;
it only reads the core and keeps what a status page needs over time (the
learners' progress and loss curves, liveness changes as events, write failures).
"""
from __future__ import annotations

import collections
import logging
import shutil
from pathlib import Path

from wan_diloco.checkpoint import describe_os_error
from wan_diloco.core import ProtocolError
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.transport import Rejected

log = logging.getLogger("wan_diloco.runtime.syncer")
LOSS_POINTS = 256  # per learner on /status: the whole run's curve, thinned as it grows (``LossCurve``)
EVENTS = 200  # learners joined, lost, rejoined and warnings on /status (merges are in ``history``)


class StatusPage:
    """Mixed into ``SyncerService``: reads its core pieces, owns the reporting state (and counts refusals)."""

    def _init_status(self) -> None:
        self.progress: dict[int, dict] = {}  # learner -> its latest loss and tokens/s (``_on_progress``)
        self.loss_history: dict[int, LossCurve] = {}  # learner -> its loss curve (the dashboard's)
        self.events: collections.deque = collections.deque(maxlen=EVENTS)
        self._liveness: dict[int, bool] = {}  # as of the last event: what ``_note_liveness`` compares with
        # Writes that failed (snapshot parts, manifests, the final parameters): /status["storage"].
        self.write_failures = 0
        self.write_error: str | None = None  # the latest failure's; None again after a write succeeds
        self.last_write_error: str | None = None
        self.params_error: str | None = None  # the final parameters could not be written: the run failed

    def _refuse(self, e: ProtocolError, frame=None) -> Rejected:
        """A learner message refused: counted by field (on /metrics and /status), logged rate-limited
        by the core. ``frame``: one that did not decode, counted here against its sender's credential."""
        field = getattr(e, "field", "") or "frame"  # serde names the field of what did not decode
        if frame is not None:
            try:
                m = serde.learner_id(frame.sender, self.M)
            except ProtocolError:
                m = None
            self.core.refused(self.now(), m, ProtocolError(str(e), field))
        self.refused_total.labels(field).inc()
        self._log_notices()
        return self._reject(e)

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
            "resumed_from": self.core.resumed_from, "snapshots_complete": len(self.snapshots.complete),
            "recoveries_served": self.donations.served, "donors_replaced": self.donations.replaced,
            "recovery_bytes": self.donations.received_bytes,
            "refused": dict(self.core.refusals.by_field),  # learner messages refused, by field (core.refusals)
            "last_snapshot": self.snapshots.last_complete,
            "storage": self.storage(),
        }

    def status(self) -> dict:
        """The /status page: learners, regions, versions per fragment, quorum sizes, grace, bytes."""
        now = self.now()
        learners = {}
        for m in range(self.M):
            info = self.core.learners.get(m)
            learners[str(m)] = {
                "region": self.region(m),
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

    def _warn(self, what: str, learner: int | None = None) -> None:
        """A warning for the log, the event stream and /status."""
        log.warning("%s", what)
        emit({"event": "warning", "role": "syncer", "what": what})
        self._event("warning", learner, what)

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
                self._event(kind, m, f"learner {m} {kind} ({self.region(m)})")

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
