"""How far a learner's reported step may plausibly be (docs/operations.md, "Refusals and quarantine").

Learners adopt the syncer's global step (``GlobalUpdate.global_step``), and the global step is the
highest step any learner reported: one report of ``step = run.steps`` would end every learner's run.
So a report may advance only as fast as the wall clock allows that learner:

    step <= max(last accepted step, global step) + credit
    credit = min(credit left after its last report, step_slack) + rate x seconds since that report

Catching up to the global step is free (an honest learner adopts it, and one step more after a late
merge, which the slack covers). The slack is a burst that refills through the rate, not a per-message
allowance, so a flood of reports cannot add it up; the rate term is not capped, so a learner that
trained on alone through a partition is still taken back. ``rate`` is the configured
``syncer.max_steps_per_s``, else ``PACE_FACTOR`` x the fastest pace measured of that learner (over
windows of at least ``PACE_WINDOW_S``), else (not measured yet) ``UNMEASURED_STEPS_PER_S``.

A learner this core has not heard from yet (a fresh start, a resume, one that never connected) starts
at the global step with a full slack: the first report after (re)joining is bounded by the syncer's
own global step. Sans-IO: times come in with the events.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PACE_FACTOR = 4.0  # generous: an honest learner's pace varies (evals, recompiles, a busy host) by less
PACE_WINDOW_S = 0.5  # a pace is measured over this long (shorter is noise) ...
MIN_WINDOW_S = 0.05  # ... or at least this long once the window holds half the slack
UNMEASURED_STEPS_PER_S = 1000.0  # before the first window closes: faster than any model worth a WAN run


@dataclass
class _Pace:
    step: int  # last accepted step
    at_s: float  # when it was accepted
    credit: float  # steps of slack left after it
    anchor_step: int  # start of the current measuring window
    anchor_s: float
    peak_steps_per_s: float | None = None  # fastest pace measured


class StepPace:
    """Per-learner pace bound (see the module docstring). ``check`` says whether a step is plausible;
    ``accept`` records an accepted report; nothing else changes state."""

    def __init__(self, step_slack: int, max_steps_per_s: float | None = None):
        self.slack = step_slack
        self.fixed_rate = max_steps_per_s
        self.learners: dict[int, _Pace] = {}
        # After a resume: learners trained on while no syncer ran, from the snapshot's cut until they
        # are heard from again, so their first report may be that much past the snapshot's global step.
        self.resumed_s: float | None = None
        self.cut_age_s = 0.0

    def rate(self, learner: int) -> float:
        """Steps a second ``learner`` may advance (beyond its slack)."""
        if self.fixed_rate is not None:
            return self.fixed_rate
        pace = self.learners.get(learner)
        if pace is None or pace.peak_steps_per_s is None:
            return UNMEASURED_STEPS_PER_S
        return PACE_FACTOR * pace.peak_steps_per_s

    def _credit(self, learner: int, now_s: float) -> tuple[int, float]:
        """(base step, credit) a report from ``learner`` at ``now_s`` is measured against."""
        pace = self.learners.get(learner)
        if pace is None:
            if self.resumed_s is None:
                return 0, float(self.slack)
            away_s = self.cut_age_s + max(0.0, now_s - self.resumed_s)
            return 0, self.slack + (self.fixed_rate or UNMEASURED_STEPS_PER_S) * away_s
        return pace.step, min(pace.credit, self.slack) + self.rate(learner) * max(0.0, now_s - pace.at_s)

    def bound(self, learner: int, now_s: float, global_step: int) -> int:
        """The highest step ``learner`` may report now, with the global step at ``global_step``."""
        base, credit = self._credit(learner, now_s)
        return max(base, global_step) + math.floor(credit)

    def accept(self, learner: int, now_s: float, step: int, global_step: int) -> None:
        """Record an accepted report (``step`` <= ``bound``): its advance past the global step is
        taken from the credit; the measuring window closes when it is long enough."""
        base, credit = self._credit(learner, now_s)
        spent = max(0, step - max(base, global_step))
        pace = self.learners.get(learner)
        if pace is None:
            self.learners[learner] = _Pace(step, now_s, credit - spent, step, now_s)
            return
        elapsed_s, advance = now_s - pace.anchor_s, step - pace.anchor_step
        # A window also closes once it holds half the slack, so a fast learner is measured before its
        # slack runs out; one that holds a single step measures nothing (the report before the first
        # compile and the one after it would make a fast learner look slow, and leave it no credit).
        if elapsed_s >= PACE_WINDOW_S or (elapsed_s >= MIN_WINDOW_S and advance >= self.slack / 2):
            if advance >= 2:
                pace.peak_steps_per_s = max(pace.peak_steps_per_s or 0.0, advance / elapsed_s)
            pace.anchor_step, pace.anchor_s = step, now_s
        pace.step, pace.at_s, pace.credit = max(pace.step, step), now_s, credit - spent

    def resumed(self, now_s: float, cut_age_s: float) -> None:
        """A resume from a snapshot cut ``cut_age_s`` ago: no learner has been heard from by this
        incarnation, and each may have trained on since the cut."""
        self.learners.clear()
        self.resumed_s, self.cut_age_s = now_s, max(0.0, cut_age_s)
