"""Sans-IO syncer protocol (docs/method.md, "Syncer loop"): quorum, grace window, merge, outer step.

Holds the global parameters Θ per fragment and one outer-optimizer state per
fragment. Events come in with their time; actions (broadcasts, timers) go out.
The end-of-run sync is an event too: uploads flagged ``final`` are held until
every live learner has sent all its fragments (or ``final_timeout_s`` after the
first), then every fragment is merged from all of them at once.

This module holds the events, liveness, refusals and identity; the rest has a module each:
``syncer_config`` (the settings), ``syncer_guards`` (the checks that refuse a message),
``syncer_rounds`` (rounds, their close, the final sync: ``SyncerRounds``, this core's base class) and
``syncer_state`` (the records and the snapshot form).
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Sequence

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core import fingerprint as fingerprint_lib
from wan_diloco.core import syncer_guards as guards
from wan_diloco.core.protocol import (
    FINAL_TIMER,
    SYNCER,
    Codec,
    Ema,
    FragmentUpload,
    Metadata,
    ProtocolError,
    Tensors,
    learner_node,
)
from wan_diloco.core.pace import StepPace
from wan_diloco.core.refusals import Refusals
# The settings, the checks' limits and the stats have modules of their own; importable from here as before.
from wan_diloco.core.syncer_config import SyncerConfig  # noqa: F401
from wan_diloco.core.syncer_guards import (  # noqa: F401
    CLOCK_ADVANCE, MAX_CLOCK, MAX_TIMING_S, OTHER_CLOCK_SLACK, SNAPSHOT_LEEWAY,
)
from wan_diloco.core.syncer_rounds import Round, SyncerRounds
from wan_diloco.core.syncer_state import LearnerInfo, SyncerStats, read_snapshot, snapshot_tensors  # noqa: F401
from wan_diloco.buffers import pooled_copy
from wan_diloco.merge import Workers, sum_squares
from wan_diloco.outer import OuterOptimizer


# The stages ``SyncerCore(timing=...)`` is entered around: an upload's checks (shape and clock; NaN and norm) and
# its fold into the round's running merge ("merge"), a round's whole close, and within it the end of the merge,
# the outer step (update and commit) and encoding the update.
TIMED_STAGES = ("validate_upload", "validate_norm", "close", "merge", "outer_step", "encode")


def _untimed(stage: str) -> AbstractContextManager[None]:
    return nullcontext()


class SyncerCore(SyncerRounds):
    def __init__(
        self,
        cfg: SyncerConfig,
        fragments: list[tuple[str, ...]],
        params: Tensors,
        is_embedding: Callable[[str], bool],
        codec: Codec,
        owned: Sequence[int] | None = None,
        workers: int | None = None,
        timing: Callable[[str], AbstractContextManager[Any]] | None = None,
    ):
        """``owned``: the fragments this core merges (a syncer shard's); None: all of them. Θ and
        outer state exist only for those; ``params`` needs only their tensors. ``workers``: threads
        for the checks, merge and outer step of a fragment (None: one per core; 1: none). ``timing``:
        a profiler's hook (bench/syncer.py), entered around each stage of the hot path with the stage's
        name (``TIMED_STAGES``); the core reads no clock itself. It may be replaced at any time."""
        cfg.validate()
        self.timing = timing or _untimed
        self.cfg = cfg
        self.fragments = fragments
        self.is_embedding = is_embedding
        self.codec = codec
        P = len(fragments)
        self.owned = tuple(range(P)) if owned is None else tuple(sorted(set(owned)))
        if not self.owned or not all(isinstance(p, int) and 0 <= p < P for p in self.owned):
            raise ValueError(f"owned fragments must be a non-empty subset of 0..{P - 1}, got {owned!r}")
        mine = set(self.owned)
        self.theta = [pooled_copy({n: params[n] for n in f}) if p in mine else {} for p, f in enumerate(fragments)]
        self.version = [0] * len(fragments)
        # ||Θ_p||² for the norm check: Θ_p changes only in ``_close`` and ``restore``, which set it
        # (None: compute on the next upload).
        self.theta_sq: list[float | None] = [None] * len(fragments)
        self.workers = Workers(workers if workers is not None else cfg.threads or None)
        if hasattr(codec, "workers"):
            codec.workers = self.workers
        self.outer = OuterOptimizer(cfg.outer, {p: self.theta[p] for p in self.owned})
        self.rounds: dict[tuple[int, int], Round] = {}
        self.carried: list[dict[int, FragmentUpload]] = [{} for _ in fragments]  # per fragment, per learner
        self.last_closed_due = [0] * len(fragments)
        self.learners: dict[int, LearnerInfo] = {}
        self.global_step = 0
        self.started_s: float | None = None
        self.clock = VectorClock()
        self.quorum_wait_s = Ema()
        self.stats = SyncerStats(fragment_syncs=[0] * len(fragments))
        self.finals: dict[tuple[int, int], FragmentUpload] = {}  # (learner, fragment) -> final upload
        self.final_started = False
        self.final_done = False
        # Identity, set by the driver: the run, this incarnation (1 fresh; a resume: max(every incarnation seen) + 1), its snapshot.
        self.run_id = ""
        self.epoch = 1
        self.resumed_from = 0
        self.snapshot_id = 0  # the newest snapshot cut (announced to learners: ``snapshots.SnapshotCoordinator``)
        self.merged_at: dict[tuple[int, int], int] = {}  # (learner, fragment) -> version its last Δ went into
        self.quarantined: dict[int, tuple[float, str]] = {}  # learner -> (until, why)
        self.notices: deque[str] = deque(maxlen=1000)  # what the driver should log: quarantines, refused merges
        self.nodes = {learner_node(m) for m in range(cfg.num_learners)} | {SYNCER}
        self.pace = StepPace(cfg.step_slack, cfg.max_steps_per_s)
        self.refusals = Refusals(cfg.max_refusals, cfg.quarantine_s)
        self.now_s: float | None = None  # the latest event's time (``learner_state``)
        # The syncer's clock entry a learner may carry (``_check_clock``): what this core ticked, from
        # what a snapshot held (a resume), with leeway where others tick the same entry.
        self.syncer_ticks = 0
        self.clock_restored = 0
        self.clock_leeway = 0
        # The settings a learner must run with (``core.fingerprint``; set by the network driver, "" compares
        # nothing), and the learners refused for theirs: learner -> the one line that says why.
        self.fingerprint = ""
        self.settings_refused: dict[int, str] = {}

    # ---- events ---------------------------------------------------------------------

    def check_settings(self, learner: int, fingerprint: str) -> None:
        """A learner's settings (``Metadata.fingerprint``) against this syncer's ``fingerprint``: first,
        before anything else from it counts. ProtocolError names the differing settings; until that
        learner sends matching ones, its uploads are refused too."""
        if not self.fingerprint or not fingerprint:
            return
        differ = fingerprint_lib.differences(self.fingerprint, fingerprint)
        if differ:
            self.settings_refused[learner] = f"learner {learner}: {fingerprint_lib.SETTINGS_DIFFER}: {'; '.join(differ)}"
            raise ProtocolError(self.settings_refused[learner], "fingerprint")
        self.settings_refused.pop(learner, None)

    def on_metadata(self, now_s: float, msg: Metadata) -> list:
        """A learner's counters. Refused (ProtocolError, counted, nothing else changed) when implausible."""
        self.now_s, quarantines = now_s, self.stats.quarantines
        try:
            return self._on_metadata(now_s, msg)
        except ProtocolError as e:
            self._refused(now_s, msg.learner, e, logged=self.stats.quarantines > quarantines)
            raise

    def _on_metadata(self, now_s: float, msg: Metadata) -> list:
        self._check_learner(msg.learner)
        self.check_settings(msg.learner, msg.fingerprint)
        guards.check_quarantine(now_s, msg.learner, self.quarantined)
        self._check_clock(msg.learner, msg.clock)
        guards.check_metadata(self.cfg, msg, now_s, self.pace, self.global_step, len(self.fragments), self.epoch,
                              self.snapshot_id)
        self.pace.accept(msg.learner, now_s, msg.step, self.global_step)
        info = self._seen(now_s, msg.learner)
        info.step = max(info.step, msg.step)
        info.step_s = msg.step_s if msg.step_s is not None else info.step_s
        info.sync_s = msg.sync_s if msg.sync_s is not None else info.sync_s
        info.tau = msg.tau if msg.tau is not None else info.tau
        self.global_step = max(self.global_step, msg.step)
        self.clock = self.clock.merge(msg.clock)
        return []

    def on_fragment(self, now_s: float, msg: FragmentUpload) -> list:
        """A learner's Δ for fragment p. Validated before any state changes; a refusal is counted."""
        self.now_s, quarantines = now_s, self.stats.quarantines
        try:
            return self._on_fragment(now_s, msg)
        except ProtocolError as e:
            self._refused(now_s, msg.learner, e, logged=self.stats.quarantines > quarantines)
            raise

    def _on_fragment(self, now_s: float, msg: FragmentUpload) -> list:
        if msg.learner in self.settings_refused:
            raise ProtocolError(self.settings_refused[msg.learner], "fingerprint")
        guards.check_quarantine(now_s, msg.learner, self.quarantined)
        self._check_learner(msg.learner)
        with self.timing("validate_upload"):
            self._check_clock(msg.learner, msg.clock)
            guards.check_upload(self.cfg, msg, self.owned, self.epoch, self.version, self.theta)
        bound = self.pace.bound(msg.learner, now_s, self.global_step)
        if msg.due_step > bound:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: due step {msg.due_step} is past what "
                                f"its pace allows now ({bound})", "upload.due_step")
        with self.timing("validate_norm"):
            delta_sq = self._check_norm(now_s, msg)
        self._seen(now_s, msg.learner)
        self.clock = self.clock.merge(msg.clock)
        self.stats.bytes_in += msg.nbytes
        if msg.epoch and msg.epoch != self.epoch:
            self.stats.stale_epoch += 1  # its base version means another Θ: the learner rejoins first
            return []
        if msg.final:
            return self._final_upload(now_s, msg)
        p = msg.fragment
        if msg.base_version < self.version[p] - self.cfg.max_staleness:
            self.stats.stale_dropped += 1
            return []
        if msg.base_version < self.merged_at.get((msg.learner, p), 0):
            # Sent before the learner saw the merge of its previous Δ: it repeats those steps.
            self.stats.duplicate_dropped += 1
            return []
        if msg.due_step <= self.last_closed_due[p]:
            self._late([msg])  # its round closed without it; the learner gets Θ anyway
            return []
        key = (p, msg.due_step)
        rnd = self.rounds.setdefault(key, Round(opened_s=now_s))
        if msg.learner in rnd.contributions:
            return []  # a resend after a reconnect
        self._contribute(rnd, msg, delta_sq)
        rnd.received_s[msg.learner] = now_s
        return self._maybe_close(now_s, key)

    def on_timer(self, now_s: float, key: tuple[int, int]) -> list:
        self.now_s = now_s
        if key == FINAL_TIMER:
            return self._final_sync(now_s)
        if key not in self.rounds:
            return []
        return self._maybe_close(now_s, key)

    def on_peer_lost(self, now_s: float, learner: int) -> list:
        """The driver saw a learner go away (stream closed, process died)."""
        self.now_s = now_s
        self._check_learner(learner)
        self._lose(learner, now_s)
        return self._recheck(now_s)

    def tick(self, now_s: float) -> list:
        """Time passed: learners silent for longer than the liveness timeout stop being waited for."""
        self.now_s = now_s
        if self.started_s is None:
            self.started_s = now_s
        for m in range(self.cfg.num_learners):
            info = self.learners.get(m)
            last = info.last_seen_s if info is not None else self.started_s
            if now_s - last > self.cfg.liveness_timeout_s:
                self._lose(m, now_s)
        return self._recheck(now_s)

    # ---- liveness -------------------------------------------------------------------

    def owns(self, p: int) -> bool:
        """Whether fragment ``p`` is this core's (a syncer shard's) to merge."""
        return p in self.outer.states

    def alive(self) -> list[int]:
        """Learners not known to be down; one never heard from is still expected."""
        return [m for m in range(self.cfg.num_learners) if m not in self.learners or self.learners[m].alive]

    def learner_state(self, m: int) -> str:
        """"waiting" (never heard from), "quarantined", "alive" or "lost", as of the latest event.
        Unlike ``alive``, which the quorum counts on, a learner that never connected is not alive."""
        self._check_learner(m)
        info = self.learners.get(m)
        if info is None or not info.heard:
            return "waiting"
        until = self.quarantined.get(m, (0.0, ""))[0]
        if self.now_s is not None and self.now_s < until:
            return "quarantined"
        return "alive" if info.alive else "lost"

    def connected(self) -> list[int]:
        """Learners heard from and alive (not waiting, lost or quarantined): what /status calls alive."""
        return [m for m in range(self.cfg.num_learners) if self.learner_state(m) == "alive"]

    def resumed_after(self, now_s: float, cut_age_s: float) -> None:
        """The driver resumed this core from a snapshot cut ``cut_age_s`` ago (wall clock): learners may
        have trained on since, and carry syncer clock ticks the snapshot missed."""
        self.pace.resumed(now_s, cut_age_s)
        self.clock_leeway = CLOCK_ADVANCE

    # ---- internals ------------------------------------------------------------------

    def _check_learner(self, learner: int) -> None:
        guards.check_learner(learner, self.cfg.num_learners)

    def _check_clock(self, learner: int, clock: VectorClock) -> None:
        shard = len(self.fragments) if len(self.owned) < len(self.fragments) else None
        limit = guards.syncer_clock_limit(self.clock_restored, self.syncer_ticks, self.clock_leeway, shard)
        guards.check_clock(learner, clock, self.clock, self.nodes, self.cfg.num_learners, limit)

    def _check_norm(self, now_s: float, msg: FragmentUpload) -> dict[str, float]:
        """Refuse NaN/Inf in Δ, and an absurd Δ (see ``max_delta_ratio``), quarantining the learner that
        sent the latter. Returns ‖Δ_t‖² by tensor name (RDA's norms)."""
        delta_sq = dict(zip(msg.delta, guards.delta_sum_squares(msg, self.workers).tolist()))
        p = msg.fragment
        if self.theta_sq[p] is None:
            self.theta_sq[p] = float(sum_squares(list(self.theta[p].values()), self.workers).sum())
        why = guards.norm_excess(p, sum(delta_sq.values()), self.theta_sq[p], self.cfg.max_delta_ratio)
        if why is not None:
            self.quarantine(now_s, msg.learner, why)
            raise ProtocolError(f"learner {msg.learner}: {why}; quarantined for {self.cfg.quarantine_s:g} s",
                                "upload.delta")
        return delta_sq

    def quarantine(self, now_s: float, learner: int, why: str) -> None:
        """Ignore ``learner`` for ``quarantine_s``: its messages are refused, and from the next ``tick``
        on no round waits for it."""
        self._check_learner(learner)
        self.quarantined[learner] = (now_s + self.cfg.quarantine_s, why)
        self.stats.quarantines += 1
        self.notices.append(f"learner {learner} quarantined for {self.cfg.quarantine_s:g} s: {why}")
        self._lose(learner, now_s)

    def refused(self, now_s: float, learner: int | None, e: ProtocolError) -> None:
        """A message the driver refused before it became an event (it did not decode): counted and
        logged like the core's own refusals, against ``learner`` (its credential's) when known."""
        self.now_s = now_s
        self._refused(now_s, learner, e)

    def _refused(self, now_s: float, learner: int | None, e: ProtocolError, logged: bool = False) -> None:
        """Count a refusal of ``learner``'s message; log it (rate-limited; ``logged``: its quarantine
        notice says it already); quarantine a learner refused ``max_refusals`` times within
        ``quarantine_s`` (the run goes on without it meanwhile)."""
        valid = isinstance(learner, int) and not isinstance(learner, bool) and 0 <= learner < self.cfg.num_learners
        line, due = self.refusals.record(now_s, learner if valid else None, e.field, str(e))
        if line is not None and not logged:
            self.notices.append(line)
        if due and valid and now_s >= self.quarantined.get(learner, (0.0, ""))[0]:
            self.quarantine(now_s, learner, f"{self.cfg.max_refusals} messages refused within "
                                            f"{self.cfg.quarantine_s:g} s (the latest: {e.field or 'other'})")

    def _lose(self, learner: int, now_s: float) -> None:
        info = self.learners.setdefault(learner, LearnerInfo(last_seen_s=now_s))
        info.alive = False

    def _seen(self, now_s: float, learner: int) -> LearnerInfo:
        if self.started_s is None:
            self.started_s = now_s
        info = self.learners.get(learner)
        if info is None:
            info = self.learners[learner] = LearnerInfo(last_seen_s=now_s)
        info.last_seen_s = now_s
        info.alive = True
        info.heard = True
        return info

    def global_params(self) -> dict[str, np.ndarray]:
        return {n: a for frag in self.theta for n, a in frag.items()}

    # ---- snapshots ----------------------------------------------------------------

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(tensors, info) of the state a resume needs: Θ and outer momentum per fragment, versions,
        counters, identity (``syncer_state.snapshot_tensors``: Θ arrays shared, not copied)."""
        tensors = snapshot_tensors(self.owned, self.theta, self.outer.states)
        info = {
            "run_id": self.run_id, "epoch": self.epoch, "snapshot": self.snapshot_id, "versions": list(self.version),
            "global_step": self.global_step, "last_closed_due": list(self.last_closed_due),
            "clock": self.clock.to_dict(), "fragment_syncs": list(self.stats.fragment_syncs),
            "merged_at": [[m, p, v] for (m, p), v in sorted(self.merged_at.items())],
            "fragments": [list(f) for f in self.fragments], "owned": list(self.owned),
        }
        return tensors, info

    def restore(self, tensors: Tensors, info: dict[str, Any]) -> None:
        """Take the state of ``export`` (a snapshot); ValueError names what does not fit this run,
        and nothing changes then."""
        r = read_snapshot(tensors, info, self.fragments, self.owned, self.theta, self.outer.states)
        self.theta, self.version, self.last_closed_due = r.theta, r.versions, r.last_closed_due
        self.theta_sq = [None] * len(self.fragments)
        for p, state in r.outer.items():
            self.outer.set_state(p, state)
        self.stats.fragment_syncs = r.fragment_syncs
        self.global_step, self.clock, self.merged_at = r.global_step, r.clock, r.merged_at
        self.clock_restored, self.syncer_ticks = r.clock[SYNCER], 0
        self.run_id, self.epoch, self.snapshot_id = r.run_id, r.epoch, r.snapshot
        self.rounds.clear()
        self.carried = [{} for _ in self.fragments]

    def start(self, run_id: str, fingerprint: str = "") -> None:
        """The driver's identity of this run: its id (a fresh start; a resume takes the snapshot's) and
        the settings every learner must run with (``core.fingerprint``; "" compares nothing)."""
        if run_id:
            self.run_id = run_id
        self.fingerprint = fingerprint

    def cut_snapshot(self, snapshot: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Snapshot ``snapshot`` is cut now; (tensors, info) as ``export``."""
        self.snapshot_id = snapshot
        return self.export()

    def next_incarnation(self, snapshot: int, epoch_seen: int = 0) -> None:
        """Resumed from ``snapshot`` (``restore`` done): this is the next incarnation of the syncer, one past
        every incarnation the run had (``epoch_seen``: the highest its store recorded). The snapshot's epoch
        + 1 alone would repeat a number when two resumes take up the same snapshot, and learners could not
        tell the dead incarnation's messages from the live one's."""
        self.epoch = max(self.epoch, epoch_seen) + 1
        self.resumed_from = self.snapshot_id = snapshot
