"""Sans-IO start barrier: no learner trains before ``need`` learners of the run have joined.

Without it a short run is trained by whichever learner compiled first: it can use the whole
global step budget before a slower peer has joined (the peer is then "recovered" at the end
with nothing trained). The syncer holds a ``StartBarrier`` and counts a learner as joined at
its first metadata (sent once it holds the global parameters); the learners hold a
``BarrierView`` of what the syncer last said and take no step until it says ``started``.
Once met, the barrier stays met for the whole run (a rejoin or a late start does not wait),
also across a resume from a snapshot of a started run. A barrier that is not met within
``timeout_s`` fails the run, naming the learners that never joined.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AnnounceBarrier:
    """Driver: tell every learner the barrier's state (``status``: need, joined, waiting_for, started);
    ``met``: this join met it (say so in the log and the events)."""

    status: dict
    met: bool


@dataclass(frozen=True)
class FailRun:
    """Driver: the run cannot go on (``why``, one line): end the serving loop, exit non-zero."""

    why: str


def barrier_need(configured: int, learners: int) -> int:
    """``run.min_learners_to_start`` as the syncer applies it: 0 means 1 (a standalone syncer); ``launch``
    writes every learner of the run into the run's config instead."""
    return min(learners, configured) if configured > 0 else 1


@dataclass
class StartBarrier:
    """The syncer's side: who joined, and whether the run may start."""

    need: int
    learners: int
    timeout_s: float
    joined: set[int] = field(default_factory=set)
    started: bool = False
    opened_s: float | None = None
    failed: str | None = None  # why the run failed here (not met in time); said once

    def __post_init__(self) -> None:
        if not 1 <= self.need <= self.learners:
            raise ValueError(f"min_learners_to_start: must be in 1..{self.learners} (run.learners), got {self.need}")
        if not self.timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.timeout_s}")

    def open(self, now_s: float) -> None:
        """The syncer listens: the timeout counts from here."""
        if self.opened_s is None:
            self.opened_s = now_s

    def on_joined(self, now_s: float, learner: int) -> bool:
        """``learner`` joined (its first metadata); True when this join met the barrier (announce it)."""
        self.open(now_s)
        if not 0 <= learner < self.learners:
            raise ValueError(f"learner {learner} out of range 0..{self.learners - 1}")
        self.joined.add(learner)
        if not self.started and len(self.joined) >= self.need:
            self.started = True
            return True
        return False

    def on_metadata(self, now_s: float, learner: int) -> list:
        """A learner's metadata: its first one is its join (it holds Θ and is ready to train); every
        learner then hears who is still missing, and that the run starts once enough have joined."""
        if learner in self.joined:
            return []
        met = self.on_joined(now_s, learner)
        return [AnnounceBarrier(self.status(), met)]

    def on_tick(self, now_s: float) -> list:
        """The clock moved: a barrier not met within ``timeout_s`` of opening fails the run, once."""
        self.open(now_s)
        if self.failed is None and self.expired(now_s):
            self.failed = self.failure()
            return [FailRun(self.failed)]
        return []

    def resumed(self, started: bool) -> None:
        """A resume from a snapshot of a run that had ``started``: it stays started (its learners come
        back to go on, not to wait for each other)."""
        self.started = self.started or bool(started)

    def waiting_for(self) -> list[int]:
        """Learners not joined yet (all of them may be needed: which ones the barrier waits for is any ``need``)."""
        return [m for m in range(self.learners) if m not in self.joined]

    def expired(self, now_s: float) -> bool:
        """Not met within ``timeout_s`` of opening: the run cannot start."""
        return not self.started and self.opened_s is not None and now_s - self.opened_s > self.timeout_s

    def failure(self) -> str:
        """The one line a run that timed out at the barrier ends with."""
        missing = self.waiting_for()
        return (f"start barrier: {len(self.joined)} of the {self.need} learners needed joined within "
                f"{self.timeout_s:g} s (run.start_timeout_s); never joined: "
                + ", ".join(f"learner-{m}" for m in missing))

    def status(self) -> dict:
        """``/status["barrier"]`` and the Barrier control frame's fields."""
        return {"need": self.need, "joined": sorted(self.joined), "waiting_for": self.waiting_for(),
                "started": self.started}


@dataclass
class BarrierView:
    """A learner's side: what the syncer last said about the barrier. It trains only once ``started``;
    it gives up ``timeout_s`` after it began waiting (the syncer fails the run then too)."""

    timeout_s: float
    started: bool = False
    need: int = 0
    joined: tuple[int, ...] = ()
    waiting_for: tuple[int, ...] = ()
    since_s: float | None = None

    def on_status(self, started: bool, need: int, joined, waiting_for) -> bool:
        """A Barrier frame arrived; True when what it says changed (worth a line in the log)."""
        new = (self.started or started, need, tuple(joined), tuple(waiting_for))
        changed = new != (self.started, self.need, self.joined, self.waiting_for)
        self.started, self.need, self.joined, self.waiting_for = new
        return changed

    def must_wait(self, now_s: float) -> bool:
        if self.since_s is None:
            self.since_s = now_s
        return not self.started

    def expired(self, now_s: float) -> bool:
        return not self.started and self.since_s is not None and now_s - self.since_s > self.timeout_s

    def failure(self) -> str:
        missing = ", ".join(f"learner-{m}" for m in self.waiting_for) or "(the syncer never said)"
        return (f"start barrier: the run did not start within {self.timeout_s:g} s (run.start_timeout_s): "
                f"{len(self.joined)} of {self.need or '?'} learners joined; never joined: {missing}")
