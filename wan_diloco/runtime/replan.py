"""τ re-planned from the measured link while a learner trains (``plan.adapt_tau``).

Learner-local: τ only says how long this learner lets a fragment travel before it waits, so no
peer has to agree (``LearnerCore.retune`` takes it). The planning rules are ``planning``'s; this
module keeps the samples and decides when a plan is due.
"""
from __future__ import annotations

import collections

from wan_diloco.config import ConfigError
from wan_diloco.core import LearnerCore
from wan_diloco.fragments import tau_bounds
from wan_diloco.planning import LinkEstimate, confirmed_move, replan_reasons, tau_for_link
from wan_diloco.runtime.events import emit

REPLAN_MIN_STEPS = 5  # steps timed before τ is planned from a link (τ counts steps)


class Replanner:
    """The links measured by one learner and the τ planned for them."""

    def __init__(self, cfg, learner: int, region: str, max_fragment_bytes: int):
        """``cfg``: the run's spec (``plan``, ``learner.sync_every``); ``max_fragment_bytes``: the codec's bound
        on one fragment on the wire, used until uploads say what actually goes out."""
        self.cfg, self.m, self.region = cfg, learner, region
        self.max_fragment_bytes = max_fragment_bytes
        self.link = None  # the latest LinkSample
        self.planned_link: LinkEstimate | None = None  # the link the current τ was planned for
        self.unplanned: LinkEstimate | None = None  # a sample that came before the step time was known
        self.recent_links: collections.deque[LinkEstimate] = collections.deque(maxlen=cfg.plan.replan_confirm)

    def on_link(self, sample, core: LearnerCore, payload_bytes: int, uploads: int) -> None:
        """A link measurement: log it (the run's metrics JSONL), keep it, and re-plan τ if asked to."""
        self.link = sample
        emit({"event": "link", "role": "learner", "learner": self.m, "region": self.region, "step": core.step,
              **sample.to_event()})
        if self.cfg.plan.adapt_tau and sample.rate_gbit_s > 0:
            try:
                self.replan(LinkEstimate(sample.rate_gbit_s, sample.rtt_s), core, payload_bytes, uploads)
            except ConfigError as e:  # a measurement the planner cannot use must not end the run
                emit({"event": "warning", "role": "learner", "learner": self.m, "what": f"no re-plan: {e}"})

    def after_step(self, core: LearnerCore, payload_bytes: int, uploads: int) -> None:
        """A sample that waited for the step time is planned once enough steps are timed."""
        if self.unplanned is not None and core.step >= REPLAN_MIN_STEPS:
            self.replan(self.unplanned, core, payload_bytes, uploads, fresh=False)

    def replan(self, link: LinkEstimate, core: LearnerCore, payload_bytes: int, uploads: int,
               fresh: bool = True) -> None:
        """τ = the smallest this link allows (``planning.tau_for_link``), when the link moved enough:
        beyond ``replan_threshold`` in ``replan_confirm`` probes in a row (``planning.confirmed_move``).

        Until a few steps are timed, the sample waits: τ is counted in steps."""
        if fresh:
            self.recent_links.append(link)
        step_s = core.step_s.value
        if step_s is None or core.step < REPLAN_MIN_STEPS:
            self.unplanned = link
            return
        self.unplanned = None
        plan = self.cfg.plan
        if self.planned_link is None:
            reasons = [f"first plan: rate {link.rate_gbit_s:.3g} Gbit/s, rtt {link.rtt_s * 1e3:.1f} ms measured"]
        else:
            moved = confirmed_move(self.planned_link, self.recent_links, plan.replan_threshold, plan.replan_confirm)
            if moved is None:
                return
            link = moved
            reasons = replan_reasons({self.region: self.planned_link}, {self.region: link}, plan.replan_threshold)
            if plan.replan_confirm > 1:
                reasons.append(f"seen in {plan.replan_confirm} probes in a row")
        self.planned_link = link
        _, cap = tau_bounds(self.cfg.learner.sync_every, self.cfg.learner.num_fragments, plan.max_tau)
        # What actually goes on the wire per fragment so far (compressed), else the codec's bound.
        frag_bytes = payload_bytes / uploads if uploads else self.max_fragment_bytes
        tau = tau_for_link(frag_bytes, link, step_s, plan.margin, sync_s=0.0, max_tau=cap)
        if tau is None:
            tau = cap
            reasons.append(f"the round trip needs more than tau = {cap} steps; using {cap}")
        old = core.cfg.tau
        core.retune(tau)
        emit({"event": "replan", "role": "learner", "learner": self.m, "region": self.region, "step": core.step,
              "tau_old": old, "tau_new": tau, "step_s": round(step_s, 4), "fragment_bytes": int(frag_bytes),
              "reasons": reasons})
