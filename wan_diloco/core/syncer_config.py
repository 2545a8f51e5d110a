"""The syncer's settings (``[syncer]``), checked at load with errors that name the field."""
from __future__ import annotations

import math
from dataclasses import dataclass

from wan_diloco.config import require
from wan_diloco.core.learner import LearnerConfig
from wan_diloco.merge import MergeMethod
from wan_diloco.outer import OuterConfig


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
    # Threads of the syncer's hot path (decoding uploads with their checks, the merge, the outer step):
    # 0 = every core this process may run on. Any number gives the same bits (chunks are cut the same way).
    threads: int = 0

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
        require(isinstance(self.threads, int) and not isinstance(self.threads, bool) and self.threads >= 0,
                "threads", f"must be an integer >= 0 (0: every core), got {self.threads!r}")
        self.outer.validate()
