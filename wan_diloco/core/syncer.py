"""Sans-IO syncer protocol (docs/method.md, "Syncer loop"): quorum, grace window, merge, outer step.

Holds the global parameters Θ per fragment and one outer-optimizer state per
fragment. Events come in with their time; actions (broadcasts, timers) go out.
The end-of-run sync is an event too: uploads flagged ``final`` are held until
every live learner has sent all its fragments (or ``final_timeout_s`` after the
first), then every fragment is merged from all of them at once.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from wan_diloco import tree
from wan_diloco.clock import VectorClock
from wan_diloco.config import require
from wan_diloco.core import fingerprint as fingerprint_lib
from wan_diloco.core.protocol import (
    FINAL_TIMER,
    SYNCER,
    Broadcast,
    Codec,
    Ema,
    FragmentUpload,
    GlobalUpdate,
    Metadata,
    ProtocolError,
    SetTimer,
    Tensors,
    encode_or_refuse,
    learner_node,
)
from wan_diloco.core.learner import LearnerConfig
from wan_diloco.core.pace import StepPace
from wan_diloco.core.refusals import QUARANTINED, Refusals
from wan_diloco.fragments import tau_bounds
from wan_diloco.merge import MergeMethod, Workers, chunks, merge_fragment, sum_squares, token_weights
from wan_diloco.outer import OuterConfig, OuterOptimizer


MAX_CLOCK = 1 << 53  # vector-clock entries count events: no run gets near; far from int64's end
MAX_TIMING_S = 86_400.0  # a learner's measured step or sync time past a day is nonsense (it bounds the grace)
# A learner reports the newest snapshot it wrote a part of: never far past what this syncer cut (after a
# resume from an older snapshot the learner may still name a newer one of the last incarnation).
SNAPSHOT_LEEWAY = 1000
# A learner's own clock entry may advance this much per message (it ticks a few times a step; one that
# trained on alone for a long while, or through a syncer restart, sends many ticks at once) ...
CLOCK_ADVANCE = 1 << 20
# ... and name another learner at most this far past what the syncer knows of it (it learnt it from a
# peer's state at a recovery, or from another syncer shard, a little ahead of this one).
OTHER_CLOCK_SLACK = 1 << 16


@dataclass(frozen=True)
class SyncerConfig:
    num_learners: int = 4  # M
    quorum: int = 1  # K: 1 maximizes availability, M is synchronous DiLoCo
    grace: bool = True  # adaptive grace window after the quorum is reached
    grace_safety: float = 0.8  # γ < 1: the grace never pushes a sync past τ steps
    max_grace_s: float | None = None
    tau: int = 2  # the learners' overlap, in steps (bounds the grace window); a run derives it from [learner]
    # The learners' H: a reported τ outside fragments.tau_bounds (τ < H) is refused. Derived from [learner].
    sync_every: int = LearnerConfig.sync_every
    merge: MergeMethod = "rda"
    max_staleness: int = 1  # accept a Δ whose base is this many versions behind
    # A Δ that misses its round joins the fragment's next merge instead of being dropped, so a
    # learner that is persistently a little late (phase after a rejoin, a slow region) still counts.
    carry_late: bool = True
    liveness_timeout_s: float = 30.0
    final_timeout_s: float = 60.0  # the end-of-run sync goes ahead without learners this late
    outer: OuterConfig = OuterConfig()
    max_step: int | None = None  # the run's step budget: a learner claiming a later step is refused (None: no cap)
    # An outer gradient with ||Δ_p|| > ratio * max(||Θ_p||, 1) is absurd (a diverged or hostile learner):
    # refused, and its learner quarantined for quarantine_s, so one learner cannot wreck Θ or the syncer.
    max_delta_ratio: float = 10.0
    quarantine_s: float = 60.0
    donor_timeout_s: float = 60.0  # peer recovery: a donor that has not sent its state by then is replaced
    # S syncer shards, each a process owning the fragments ``shards.owners`` gives it (balanced by bytes),
    # with its own rounds, outer state and versions: one CPU box need not take in every learner's bytes.
    shards: int = 1
    # Plausibility (core.pace): a learner's step may run this many steps past its pace (and past the
    # global step at its first report after (re)joining) ...
    step_slack: int = 32
    # ... where its pace is at most this many steps a second; None: 4 x its fastest measured pace.
    max_steps_per_s: float | None = None
    max_refusals: int = 50  # refusals of one learner within quarantine_s that quarantine it
    # Tokens one learner step trains (batch x sequence length): a counter claiming more per step would
    # outweigh the others in the token-weighted merge. None: not checked (the simulator's own learners).
    max_tokens_per_step: int | None = None
    # A learner sends its final uploads once it reached the run's budget: one flagged final from earlier
    # would start the end-of-run sync for everyone. None: not checked (the simulator ends its learners itself).
    final_min_step: int | None = None

    def validate(self) -> None:
        require(self.num_learners >= 1, "num_learners", f"must be >= 1, got {self.num_learners}")
        require(1 <= self.quorum <= self.num_learners, "quorum", f"must be in 1..num_learners ({self.num_learners}), got {self.quorum}")
        require(0 < self.grace_safety < 1, "grace_safety", f"must be in (0, 1), got {self.grace_safety}")
        require(self.max_grace_s is None or self.max_grace_s >= 0, "max_grace_s", "must be >= 0")
        require(self.tau >= 0, "tau", f"must be >= 0, got {self.tau}")
        require(isinstance(self.sync_every, int) and self.sync_every >= 1, "sync_every",
                f"must be an integer >= 1, got {self.sync_every!r}")
        require(self.merge in ("rda", "mean"), "merge", f"must be 'rda' or 'mean', got {self.merge!r}")
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.liveness_timeout_s > 0, "liveness_timeout_s", "must be > 0")
        require(self.final_timeout_s > 0, "final_timeout_s", "must be > 0")
        require(self.max_step is None or self.max_step >= 1, "max_step", f"must be >= 1, got {self.max_step}")
        require(self.max_delta_ratio > 0 and math.isfinite(self.max_delta_ratio), "max_delta_ratio",
                f"must be a finite number > 0, got {self.max_delta_ratio}")
        require(self.quarantine_s >= 0 and math.isfinite(self.quarantine_s), "quarantine_s",
                f"must be a finite number >= 0, got {self.quarantine_s}")
        require(self.donor_timeout_s > 0, "donor_timeout_s", f"must be > 0, got {self.donor_timeout_s}")
        require(isinstance(self.shards, int) and self.shards >= 1, "shards", f"must be an integer >= 1, got {self.shards!r}")
        require(isinstance(self.step_slack, int) and not isinstance(self.step_slack, bool) and self.step_slack >= 1,
                "step_slack", f"must be an integer >= 1 (steps), got {self.step_slack!r}")
        require(self.max_steps_per_s is None or (self.max_steps_per_s > 0 and math.isfinite(self.max_steps_per_s)),
                "max_steps_per_s", f"must be a finite number > 0, or unset to measure each learner's pace, "
                f"got {self.max_steps_per_s}")
        require(self.max_tokens_per_step is None or self.max_tokens_per_step >= 1, "max_tokens_per_step",
                f"must be >= 1, got {self.max_tokens_per_step}")
        require(isinstance(self.max_refusals, int) and not isinstance(self.max_refusals, bool)
                and self.max_refusals >= 1, "max_refusals", f"must be an integer >= 1, got {self.max_refusals!r}")
        self.outer.validate()


@dataclass
class _Learner:
    last_seen_s: float
    step: int = 0
    alive: bool = True
    step_s: float | None = None
    sync_s: float | None = None
    tau: int | None = None
    heard: bool = False  # it sent something; False: only ever declared lost while waited for


@dataclass
class _Round:
    opened_s: float
    contributions: dict[int, FragmentUpload] = field(default_factory=dict)
    received_s: dict[int, float] = field(default_factory=dict)
    quorum_s: float | None = None
    deadline_s: float | None = None
    grace_s: float = 0.0
    timer_set: bool = False


@dataclass
class SyncerStats:
    fragment_syncs: list[int]
    # Bounded: means over the most recent rounds, so a long networked run does not grow without end.
    quorum_sizes: deque = field(default_factory=lambda: deque(maxlen=10_000))
    grace_s: deque = field(default_factory=lambda: deque(maxlen=10_000))
    late_dropped: int = 0
    late_carried: int = 0  # late Δs merged into the fragment's next round instead
    stale_dropped: int = 0
    duplicate_dropped: int = 0  # Δs whose base predates the learner's own last merged Δ: their steps counted already
    stale_epoch: int = 0  # uploads based on an earlier syncer incarnation (before a resume)
    quarantines: int = 0
    refused_rounds: int = 0  # merges whose outer step came out non-finite: Θ kept as it was
    bytes_in: int = 0
    bytes_out: int = 0  # one copy per broadcast; the driver multiplies by recipients
    # Recent rounds: (closed at s, fragment, due step, contributors), for status pages and tests.
    history: deque = field(default_factory=lambda: deque(maxlen=10_000))


class SyncerCore:
    def __init__(
        self,
        cfg: SyncerConfig,
        fragments: list[tuple[str, ...]],
        params: Tensors,
        is_embedding: Callable[[str], bool],
        codec: Codec,
        owned: Sequence[int] | None = None,
        workers: int | None = None,
    ):
        """``owned``: the fragments this core merges (a syncer shard's); None: all of them. Θ and
        outer state exist only for those; ``params`` needs only their tensors. ``workers``: threads
        for the checks, merge and outer step of a fragment (None: one per core; 1: none)."""
        cfg.validate()
        self.cfg = cfg
        self.fragments = fragments
        self.is_embedding = is_embedding
        self.codec = codec
        P = len(fragments)
        self.owned = tuple(range(P)) if owned is None else tuple(sorted(set(owned)))
        if not self.owned or not all(isinstance(p, int) and 0 <= p < P for p in self.owned):
            raise ValueError(f"owned fragments must be a non-empty subset of 0..{P - 1}, got {owned!r}")
        mine = set(self.owned)
        self.theta = [{n: np.array(params[n], dtype=np.float32) for n in f} if p in mine else {}
                      for p, f in enumerate(fragments)]
        self.version = [0] * len(fragments)
        # ||Θ_p||² for the norm check: Θ_p changes only in ``_close`` and ``restore``, which set it
        # (None: compute on the next upload).
        self.theta_sq: list[float | None] = [None] * len(fragments)
        self.workers = Workers(workers)
        self.outer = OuterOptimizer(cfg.outer, {p: self.theta[p] for p in self.owned})
        self.rounds: dict[tuple[int, int], _Round] = {}
        self.carried: list[dict[int, FragmentUpload]] = [{} for _ in fragments]  # per fragment, per learner
        self.last_closed_due = [0] * len(fragments)
        self.learners: dict[int, _Learner] = {}
        self.global_step = 0
        self.started_s: float | None = None
        self.clock = VectorClock()
        self.quorum_wait_s = Ema()
        self.stats = SyncerStats(fragment_syncs=[0] * len(fragments))
        self.finals: dict[tuple[int, int], FragmentUpload] = {}  # (learner, fragment) -> final upload
        self.final_started = False
        self.final_done = False
        # Identity, set by the driver: the run, this incarnation (1 fresh, +1 per resume), its snapshot.
        self.run_id = ""
        self.epoch = 1
        self.resumed_from = 0
        self.snapshot_id = 0  # the newest snapshot cut: every update carries it, learners save their part
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
        self._check_quarantine(now_s, msg.learner)
        self._check_clock(msg.learner, msg.clock)
        if self.cfg.max_step is not None and msg.step > self.cfg.max_step:
            raise ProtocolError(f"metadata from learner {msg.learner}: step {msg.step} beyond the run's "
                                f"{self.cfg.max_step} steps", "metadata.step")
        bound = self.pace.bound(msg.learner, now_s, self.global_step)
        if msg.step > bound:
            raise ProtocolError(f"metadata from learner {msg.learner}: step {msg.step} is past what its pace allows "
                                f"now ({bound}: global step {self.global_step}, syncer.step_slack "
                                f"{self.cfg.step_slack}, {self.pace.rate(msg.learner):.3g} steps/s)", "metadata.step")
        if len(msg.c_steps) != len(self.fragments) or len(msg.c_tokens) != len(self.fragments):
            raise ProtocolError(f"metadata from learner {msg.learner}: counters for {len(msg.c_steps)} fragments, "
                                f"expected {len(self.fragments)}", "metadata.counters")
        lo, hi = tau_bounds(self.cfg.sync_every, len(self.fragments))
        if msg.tau is not None and not lo <= msg.tau <= hi:
            raise ProtocolError(f"metadata from learner {msg.learner}: tau must be in [{lo}, {hi}] (below H = "
                                f"{self.cfg.sync_every}), got {msg.tau}", "metadata.tau")
        self._check_metadata_counters(msg)
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
        self._check_quarantine(now_s, msg.learner)
        self._check_learner(msg.learner)
        self._validate_upload(msg)
        bound = self.pace.bound(msg.learner, now_s, self.global_step)
        if msg.due_step > bound:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: due step {msg.due_step} is past what "
                                f"its pace allows now ({bound})", "upload.due_step")
        self._check_norm(now_s, msg)
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
        rnd = self.rounds.setdefault(key, _Round(opened_s=now_s))
        if msg.learner in rnd.contributions:
            return []  # a resend after a reconnect
        rnd.contributions[msg.learner] = msg
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

    # ---- estimates ------------------------------------------------------------------

    def tau_now(self) -> int:
        """The overlap the grace must respect: the smallest any live learner reported (learners that
        re-plan τ from their links may differ; waiting past the smallest would make its learners
        merge late), else the configured one."""
        taus = [l.tau for l in self.learners.values() if l.alive and l.tau is not None]
        return min(taus) if taus else self.cfg.tau

    def grace_window_s(self) -> float:
        """ξ_grace = γ·max(0, τ·ξ_step − (ξ_quorum + ξ_sync)), all measured online (τ: ``tau_now``)."""
        if not self.cfg.grace:
            return 0.0
        steps = [l.step_s for l in self.learners.values() if l.alive and l.step_s is not None]
        if not steps:
            return 0.0
        syncs = [l.sync_s for l in self.learners.values() if l.alive and l.sync_s is not None]
        step_s = float(np.mean(steps))
        sync_s = float(np.mean(syncs)) if syncs else 0.0
        slack = self.tau_now() * step_s - ((self.quorum_wait_s.value or 0.0) + sync_s)
        grace = self.cfg.grace_safety * max(0.0, slack)
        return grace if self.cfg.max_grace_s is None else min(grace, self.cfg.max_grace_s)

    def quorum(self) -> int:
        """K for the next round: a learner known to be down cannot be waited for (>= 1)."""
        return max(1, min(self.cfg.quorum, len(self.alive())))

    def final_participants(self) -> set[int]:
        return {m for (m, _) in self.finals}

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
        if not isinstance(learner, int) or not 0 <= learner < self.cfg.num_learners:
            raise ProtocolError(f"learner id {learner!r} out of range 0..{self.cfg.num_learners - 1}", "learner")

    def _check_quarantine(self, now_s: float, learner: int) -> None:
        until, why = self.quarantined.get(learner, (0.0, ""))
        if now_s < until:
            raise ProtocolError(f"learner {learner} is quarantined for another {until - now_s:.0f} s: {why}", QUARANTINED)

    def _check_clock(self, learner: int, clock: VectorClock) -> None:
        """Only this run's nodes (a clock naming others would ride on every later message), and no
        entry near the wire's int64 limit (the syncer's next tick would overflow it, and every update
        after would be refused on the way out)."""
        huge = [n for n, v in clock.entries.items() if v > MAX_CLOCK]
        if huge:
            raise ProtocolError(f"vector clock from learner {learner}: entry {huge[0][:40]!r} = "
                                f"{clock[huge[0]]} is beyond {MAX_CLOCK}", "clock")
        unknown = sorted(set(clock.entries) - self.nodes)
        if unknown:
            raise ProtocolError(f"vector clock from learner {learner}: {len(unknown)} unknown node(s), e.g. "
                                f"{unknown[0][:40]!r}; this run has learner-0..learner-{self.cfg.num_learners - 1} "
                                f"and {SYNCER!r}", "clock")
        # No entry far past what the syncer issued or knows: merged into its clock, it would ride on every
        # update, and one near MAX_CLOCK would have every later message refused.
        own = learner_node(learner)
        for node, value in clock.entries.items():
            limit = self._clock_limit(node, own)
            if value > limit:
                raise ProtocolError(f"vector clock from learner {learner}: entry {node!r} = {value} is past what the "
                                    f"syncer issued or knows ({limit})", "clock")

    def _clock_limit(self, node: str, own: str) -> int:
        if node == own:
            return self.clock[node] + CLOCK_ADVANCE
        if node != SYNCER:
            return self.clock[node] + OTHER_CLOCK_SLACK
        if len(self.owned) < len(self.fragments):
            # A shard: learners carry every shard's ticks of this entry, about P times its own at most.
            return self.clock_restored + self.syncer_ticks * len(self.fragments) + CLOCK_ADVANCE
        return self.clock_restored + self.syncer_ticks + self.clock_leeway

    def _check_norm(self, now_s: float, msg: FragmentUpload) -> None:
        """Refuse NaN/Inf in Δ, and an absurd Δ (see ``max_delta_ratio``), quarantining the learner that
        sent the latter. One pass over Δ serves both: NaN or Inf makes its sum of squares non-finite."""
        sq = sum_squares(list(msg.delta.values()), self.workers)
        if not np.all(np.isfinite(sq)):
            bad = next(n for n, x in zip(msg.delta, sq) if not math.isfinite(x))
            raise ProtocolError(f"{bad!r} from learner {msg.learner}: NaN or Inf in the outer gradient", "upload.delta")
        p = msg.fragment
        if self.theta_sq[p] is None:
            self.theta_sq[p] = float(sum_squares(list(self.theta[p].values()), self.workers).sum())
        delta, theta = math.sqrt(float(sq.sum())), math.sqrt(self.theta_sq[p])
        limit = self.cfg.max_delta_ratio * max(theta, 1.0)
        if delta > limit:
            why = (f"outer gradient of fragment {p} has norm {delta:.3g}, over {self.cfg.max_delta_ratio:g}"
                   f" x max(|Theta|, 1) = {limit:.3g}")
            self.quarantine(now_s, msg.learner, why)
            raise ProtocolError(f"learner {msg.learner}: {why}; quarantined for {self.cfg.quarantine_s:g} s",
                                "upload.delta")

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

    def _check_metadata_counters(self, msg: Metadata) -> None:
        """Counters and timings no honest learner reports: per-fragment steps past its step, tokens past
        its steps' worth, a negative or absurd step or sync time, an incarnation or snapshot this syncer
        never had."""
        m, step = msg.learner, msg.step
        tokens = self.cfg.max_tokens_per_step
        for name, c in (("c_steps", msg.c_steps), ("c_tokens", msg.c_tokens)):
            if any(x < 0 for x in c):
                raise ProtocolError(f"metadata from learner {m}: negative {name}", f"metadata.{name}")
        if max(msg.c_steps, default=0) > step:
            raise ProtocolError(f"metadata from learner {m}: c_steps {max(msg.c_steps)} past its step {step}",
                                "metadata.c_steps")
        if tokens is not None:
            worst = max((t - c * tokens for t, c in zip(msg.c_tokens, msg.c_steps)), default=0)
            if worst > 0:
                raise ProtocolError(f"metadata from learner {m}: c_tokens past {tokens} tokens a step "
                                    "(syncer.max_tokens_per_step)", "metadata.c_tokens")
            if msg.tokens > (step + self.cfg.step_slack) * tokens:
                raise ProtocolError(f"metadata from learner {m}: {msg.tokens} tokens trained in {step} steps of "
                                    f"at most {tokens}", "metadata.tokens")
        for name in ("step_s", "sync_s"):
            v = getattr(msg, name)
            if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_TIMING_S):
                raise ProtocolError(f"metadata from learner {m}: {name} must be in [0, {MAX_TIMING_S:g}] s, got {v}",
                                    f"metadata.{name}")
        if msg.epoch > self.epoch:
            raise ProtocolError(f"metadata from learner {m}: incarnation {msg.epoch}, this syncer is at {self.epoch}",
                                "metadata.epoch")
        if msg.snapshot > self.snapshot_id + SNAPSHOT_LEEWAY:
            raise ProtocolError(f"metadata from learner {m}: snapshot {msg.snapshot}, this syncer cut "
                                f"{self.snapshot_id}", "metadata.snapshot")

    def _validate_upload(self, msg: FragmentUpload) -> None:
        self._check_clock(msg.learner, msg.clock)
        if self.cfg.max_step is not None and msg.due_step > self.cfg.max_step:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: due step {msg.due_step} beyond the "
                                f"run's {self.cfg.max_step} steps", "upload.due_step")
        if not 0 <= msg.fragment < len(self.fragments):
            raise ProtocolError(f"fragment {msg.fragment} out of range 0..{len(self.fragments) - 1}", "upload.fragment")
        if not self.owns(msg.fragment):
            raise ProtocolError(f"fragment {msg.fragment} from learner {msg.learner}: this syncer shard owns "
                                f"fragments {list(self.owned)} only (a learner with another shard plan?)",
                                "upload.fragment")
        if msg.c_steps < 0 or msg.c_tokens < 0 or msg.due_step < 1 or msg.base_version < 0:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: negative counters or step",
                                "upload.counters")
        if msg.c_steps > msg.due_step + self.cfg.step_slack:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: c_steps {msg.c_steps} past its due step "
                                f"{msg.due_step}", "upload.c_steps")
        tokens = self.cfg.max_tokens_per_step
        if tokens is not None and msg.c_tokens > msg.c_steps * tokens:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: {msg.c_tokens} tokens in {msg.c_steps} "
                                f"steps of at most {tokens} (syncer.max_tokens_per_step)", "upload.c_tokens")
        if msg.epoch > self.epoch:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: incarnation {msg.epoch}, this syncer is "
                                f"at {self.epoch}", "upload.epoch")
        if msg.final and self.cfg.final_min_step is not None and msg.due_step < self.cfg.final_min_step:
            raise ProtocolError(f"fragment upload from learner {msg.learner}: final at step {msg.due_step}, before the "
                                f"run's {self.cfg.final_min_step} steps", "upload.final")
        if msg.epoch in (0, self.epoch) and msg.base_version > self.version[msg.fragment]:
            # Versions come from this syncer only (an earlier incarnation's are told apart by epoch).
            raise ProtocolError(f"fragment upload from learner {msg.learner}: base version {msg.base_version} of "
                                f"fragment {msg.fragment} is past its current version {self.version[msg.fragment]}",
                                "upload.base_version")
        theta = self.theta[msg.fragment]
        if set(msg.delta) != set(theta):
            missing = sorted(set(theta) - set(msg.delta))[:2]
            extra = sorted(set(msg.delta) - set(theta))[:2]
            raise ProtocolError(f"fragment {msg.fragment} from learner {msg.learner}: missing {missing}, "
                                f"unexpected {extra}", "upload.tensors")
        for n, d in msg.delta.items():
            if d.shape != theta[n].shape:
                raise ProtocolError(f"{n!r} from learner {msg.learner}: shape {d.shape}, expected {theta[n].shape}",
                                    "upload.shape")
        # NaN and Inf are refused by ``_check_norm``, in the same pass as the norm.

    def _late(self, msgs) -> None:
        """Δs whose round closed without them: carried into the fragment's next merge, or dropped."""
        for msg in msgs:
            if self.cfg.carry_late:
                self._carry(msg)
            else:
                self.stats.late_dropped += 1

    def _carry(self, msg: FragmentUpload) -> None:
        held = self.carried[msg.fragment]
        held[msg.learner] = msg if msg.learner not in held else _combine(held[msg.learner], msg)

    def _lose(self, learner: int, now_s: float) -> None:
        info = self.learners.setdefault(learner, _Learner(last_seen_s=now_s))
        info.alive = False

    def _seen(self, now_s: float, learner: int) -> _Learner:
        if self.started_s is None:
            self.started_s = now_s
        info = self.learners.get(learner)
        if info is None:
            info = self.learners[learner] = _Learner(last_seen_s=now_s)
        info.last_seen_s = now_s
        info.alive = True
        info.heard = True
        return info

    def _recheck(self, now_s: float) -> list:
        actions: list = []
        for key in sorted(self.rounds):
            if key in self.rounds:
                actions += self._maybe_close(now_s, key)
        if self.final_started and self._finals_complete():  # the last learner it waited for went away
            actions += self._final_sync(now_s)
        return actions

    def _maybe_close(self, now_s: float, key: tuple[int, int]) -> list:
        rnd = self.rounds[key]
        if len(rnd.contributions) < self.quorum():
            return []
        if rnd.quorum_s is None:
            rnd.quorum_s = now_s
            self.quorum_wait_s.add(now_s - rnd.opened_s)
            rnd.grace_s = self.grace_window_s()
            rnd.deadline_s = now_s + rnd.grace_s
        waiting = [m for m in self.alive() if m not in rnd.contributions]
        if not waiting or now_s >= rnd.deadline_s:
            return self._close(now_s, key)
        if not rnd.timer_set:
            rnd.timer_set = True
            return [SetTimer(key, rnd.deadline_s)]
        return []

    def _close(self, now_s: float, key: tuple[int, int], final: bool = False) -> list:
        p, due = key
        rnd = self.rounds.pop(key)
        # Older open rounds of this fragment are now late: their Θ has moved on.
        for old in [k for k in self.rounds if k[0] == p and k[1] < due]:
            self._late(self.rounds.pop(old).contributions.values())
        for m, msg in self.carried[p].items():
            if msg.base_version < self.version[p] - self.cfg.max_staleness:
                self.stats.stale_dropped += 1
                continue
            self.stats.late_carried += 1
            mine = rnd.contributions.get(m)
            rnd.contributions[m] = msg if mine is None else _combine(msg, mine)
        self.carried[p] = {}
        learners = sorted(rnd.contributions)
        ups = [rnd.contributions[m] for m in learners]
        weights = token_weights([u.c_tokens for u in ups], [u.c_steps for u in ups])
        if weights.sum() <= 0:
            weights = np.ones(len(ups))
        delta = merge_fragment([u.delta for u in ups], weights, self.cfg.merge, self.is_embedding, self.workers)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                update = self.outer.update(p, delta, self.workers)
            # Everyone, the syncer included, applies the same decoded update: all copies stay bit-identical.
            # The codec refuses a non-finite update (an outer step that overflowed).
            enc = encode_or_refuse(self.codec, update, f"update of fragment {p}")
            # New arrays, not in place: a snapshot being written shares the old ones (``export``).
            new = _add(self.theta[p], enc.values, self.workers)
            theta_sq = float(sum_squares(list(new.values()), self.workers).sum())  # the next norm check's
            if not math.isfinite(theta_sq):
                raise ProtocolError("the outer step overflowed (non-finite result)")
        except ProtocolError as e:
            # Θ_p and its momentum stay as they were; the learners keep their Δs' steps in θ and send again.
            self.stats.refused_rounds += 1
            self.notices.append(f"merge of fragment {p} (due step {due}, learners {learners}) refused: {e}")
            return []
        self.outer.commit(p, delta, self.workers)
        self.theta[p], self.theta_sq[p] = new, theta_sq
        from_version = self.version[p]
        self.version[p] += 1
        self.last_closed_due[p] = max(self.last_closed_due[p], due)
        self.clock = self.clock.tick(SYNCER)
        self.syncer_ticks += 1
        self.stats.fragment_syncs[p] += 1
        for m in learners:
            self.merged_at[(m, p)] = self.version[p]
        self.stats.quorum_sizes.append(len(ups))
        self.stats.grace_s.append(rnd.grace_s)
        self.stats.history.append((now_s, p, due, tuple(learners)))
        self.stats.bytes_out += enc.nbytes
        msg = GlobalUpdate(
            fragment=p, from_version=from_version, to_version=self.version[p], due_step=due,
            global_step=self.global_step, clock=self.clock, update=enc.values, nbytes=enc.nbytes,
            contributors=tuple(learners), held_s={m: now_s - t for m, t in rnd.received_s.items()},
            payload=enc.payload, final=final, run_id=self.run_id, epoch=self.epoch, resumed_from=self.resumed_from,
            snapshot=self.snapshot_id,
        )
        return [Broadcast(msg)]

    # ---- end of run ---------------------------------------------------------------

    def _final_upload(self, now_s: float, msg: FragmentUpload) -> list:
        if self.final_done:
            return []  # too late: the learner takes the final fragments like everyone else
        self.finals[(msg.learner, msg.fragment)] = msg  # a retry overwrites
        actions: list = []
        if not self.final_started:
            self.final_started = True
            actions.append(SetTimer(FINAL_TIMER, now_s + self.cfg.final_timeout_s))
        if self._finals_complete():
            actions += self._final_sync(now_s)
        return actions

    def _finals_complete(self) -> bool:
        return all(all((m, p) in self.finals for p in self.owned) for m in self.alive())

    def _final_sync(self, now_s: float) -> list:
        """Merge every fragment from all final uploads at once, quorum and grace aside."""
        if self.final_done:
            return []
        self.final_done = True
        for key in list(self.rounds):  # open rounds end unmerged: their learners sent finals instead
            self.rounds.pop(key)
        actions: list = []
        for p in self.owned:
            ups = [u for (m, q), u in sorted(self.finals.items()) if q == p]
            if not ups:
                continue
            key = (p, max(u.due_step for u in ups))
            rnd = self.rounds[key] = _Round(opened_s=now_s)
            for u in ups:
                rnd.contributions[u.learner] = u
                rnd.received_s[u.learner] = now_s
            actions += self._close(now_s, key, final=True)
        return actions

    def global_params(self) -> dict[str, np.ndarray]:
        return {n: a for frag in self.theta for n, a in frag.items()}

    # ---- snapshots ----------------------------------------------------------------

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(tensors, info) of the state a resume needs: Θ and outer momentum per fragment, versions,
        counters, identity. Θ arrays are shared, not copied: the core replaces them, never writes into them."""
        tensors: dict[str, np.ndarray] = {}
        for p in self.owned:
            tensors.update({f"theta/{p}/{n}": a for n, a in self.theta[p].items()})
            tensors.update(tree.to_named(self.outer.states[p], f"outer/{p}"))
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
        P = len(self.fragments)
        if info.get("fragments") != [list(f) for f in self.fragments]:
            raise ValueError("snapshot: its fragments differ from this run's (another model or num_fragments?)")
        if list(info.get("owned", range(P))) != list(self.owned):
            raise ValueError(f"snapshot: of a syncer shard owning fragments {info.get('owned')}, this one owns "
                             f"{list(self.owned)} (another syncer.shards?)")
        theta = []
        for p, names in enumerate(self.fragments):
            frag = {}
            for n in names if self.owns(p) else ():
                a = tensors.get(f"theta/{p}/{n}")
                if a is None or a.shape != self.theta[p][n].shape or a.dtype != np.float32:
                    raise ValueError(f"snapshot: tensor theta/{p}/{n} missing or of the wrong shape or dtype")
                if not np.all(np.isfinite(a)):
                    raise ValueError(f"snapshot: tensor theta/{p}/{n} is not finite")
                frag[n] = np.array(a)
            theta.append(frag)
        outer = {p: tree.from_named(tensors, f"outer/{p}", self.outer.states[p], "snapshot") for p in self.owned}
        ints = lambda key: [int(x) for x in info[key]]  # noqa: E731
        versions, last_due, syncs = ints("versions"), ints("last_closed_due"), ints("fragment_syncs")
        if not len(versions) == len(last_due) == len(syncs) == P:
            raise ValueError(f"snapshot: counters for {len(versions)} fragments, expected {P}")
        clock = VectorClock.from_dict(info["clock"])
        merged = {(int(m), int(p)): int(v) for m, p, v in info["merged_at"]}
        self.theta, self.version, self.last_closed_due = theta, versions, last_due
        self.theta_sq = [None] * P
        for p, state in outer.items():
            self.outer.set_state(p, state)
        self.stats.fragment_syncs = syncs
        self.global_step, self.clock, self.merged_at = int(info["global_step"]), clock, merged
        self.clock_restored, self.syncer_ticks = clock[SYNCER], 0
        self.run_id, self.epoch, self.snapshot_id = str(info["run_id"]), int(info["epoch"]), int(info["snapshot"])
        self.rounds.clear()
        self.carried = [{} for _ in self.fragments]

    def start(self, run_id: str, fingerprint: str = "") -> None:
        """The driver's identity of this run: its id (a fresh start; a resume takes the snapshot's) and
        the settings every learner must run with (``core.fingerprint``; "" compares nothing)."""
        if run_id:
            self.run_id = run_id
        self.fingerprint = fingerprint

    def cut_snapshot(self, snapshot: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Snapshot ``snapshot`` is cut now: every later update carries it; (tensors, info) as ``export``."""
        self.snapshot_id = snapshot
        return self.export()

    def next_incarnation(self, snapshot: int) -> None:
        """Resumed from ``snapshot`` (``restore`` done): this is the next incarnation of the syncer."""
        self.epoch += 1
        self.resumed_from = self.snapshot_id = snapshot


def _combine(a: FragmentUpload, b: FragmentUpload) -> FragmentUpload:
    """One learner's two Δs for a fragment (a late one and a newer one) as one: its whole displacement."""
    return replace(
        b, delta={n: a.delta[n] + b.delta[n] for n in b.delta}, c_steps=a.c_steps + b.c_steps,
        c_tokens=a.c_tokens + b.c_tokens, base_version=min(a.base_version, b.base_version), nbytes=a.nbytes + b.nbytes,
        payload=None,
    )


def _add(a: Tensors, b: Tensors, workers: Workers) -> dict[str, np.ndarray]:
    """{n: a[n] + b[n]} in fresh float32 arrays, chunk by chunk on ``workers``."""
    names = list(a)
    xs, ys = [np.ravel(a[n]) for n in names], [np.ravel(b[n]) for n in names]
    out = [np.empty(x.size, np.float32) for x in xs]

    def run(it) -> None:
        i, lo, hi = it
        np.add(xs[i][lo:hi], ys[i][lo:hi], out=out[i][lo:hi])

    with np.errstate(over="ignore", invalid="ignore"):
        workers.map(run, chunks([x.size for x in xs]))
    return {n: o.reshape(np.shape(a[n])) for n, o in zip(names, out)}
