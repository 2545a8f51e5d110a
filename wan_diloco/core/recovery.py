"""Sans-IO peer recovery (docs/method.md, "Recovery"): which healthy learner gives its state to one
that (re)joins, and what happens when that donor goes away.

The syncer side is :class:`Donations`: a recipient asks (``request``), a donor
is chosen (``choose_donor``: same region first, then the least busy donor,
then the most advanced), and an ``AskDonor`` action names the global versions
V the recipient saw; the donor answers once it has seen V, without stopping
its training. If the donor is lost before its state arrives, the next donor
is asked (``peer_lost``); a recipient nobody can serve gets ``NoDonor``.
The learner side (installing the state and replaying the updates buffered
meanwhile) is ``LearnerCore.adopt`` plus the driver's replay. The simulator
and the networked runtime both go through these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Candidate:
    """What the syncer knows of a learner that could donate."""

    region: str
    step: int
    busy: int = 0  # donations it is serving now


def choose_donor(candidates: Mapping[int, Candidate], region: str, exclude: frozenset[int] = frozenset()) -> int | None:
    """The donor for a recipient in ``region``: same region (its link is the short one), then the
    least busy (a donor that already serves one would split its upload), then the most advanced, then
    the lowest id (deterministic). None if nobody can donate."""
    ok = [m for m in candidates if m not in exclude]
    if not ok:
        return None
    return min(ok, key=lambda m: (candidates[m].region != region, candidates[m].busy, -candidates[m].step, m))


@dataclass(frozen=True)
class AskDonor:
    """Driver: ask learner ``donor`` for its state for ``recipient``, once it has seen ``versions``."""

    donor: int
    recipient: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class NoDonor:
    """Driver: nobody can give ``recipient`` a state (it starts from the global parameters alone)."""

    recipient: int
    why: str


@dataclass
class _Pending:
    donor: int
    versions: tuple[int, ...]
    asked_s: float
    tried: set[int] = field(default_factory=set)


class Donations:
    """Syncer-side bookkeeping of recoveries in progress (see the module docstring)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # a donor that has not delivered by then is replaced
        self.pending: dict[int, _Pending] = {}  # recipient -> its current donor
        self.served = 0
        self.replaced = 0

    def busy(self, donor: int) -> int:
        return sum(1 for p in self.pending.values() if p.donor == donor)

    def request(self, now_s: float, recipient: int, versions: tuple[int, ...], candidates: Mapping[int, Candidate],
                region: str) -> list:
        """``recipient`` (re)joined and saw ``versions``: ask a donor (a repeated request is ignored)."""
        if recipient in self.pending:
            return []
        return self._ask(now_s, recipient, versions, candidates, region, set())

    def _ask(self, now_s, recipient, versions, candidates, region, tried: set[int]) -> list:
        cands = {m: Candidate(c.region, c.step, self.busy(m)) for m, c in candidates.items() if m != recipient}
        donor = choose_donor(cands, region, frozenset(tried))
        if donor is None:
            self.pending.pop(recipient, None)
            why = "no healthy learner to copy from" if not tried else f"donors {sorted(tried)} went away"
            return [NoDonor(recipient, why)]
        self.pending[recipient] = _Pending(donor, tuple(versions), now_s, tried | {donor})
        return [AskDonor(donor, recipient, tuple(versions))]

    def donor_of(self, recipient: int) -> int | None:
        """The donor asked now for ``recipient``'s state, if any."""
        p = self.pending.get(recipient)
        return None if p is None else p.donor

    def progress(self, now_s: float, recipient: int) -> None:
        """A part of ``recipient``'s state arrived: its donor is alive and working, so the timeout counts
        from now (a large state on a slow link may take longer than ``timeout_s`` in all)."""
        if recipient in self.pending:
            self.pending[recipient].asked_s = now_s

    def delivered(self, recipient: int, donor: int) -> bool:
        """The state for ``recipient`` arrived from ``donor``; False if that donor was not (or no longer) asked."""
        p = self.pending.get(recipient)
        if p is None or p.donor != donor:
            return False
        del self.pending[recipient]
        self.served += 1
        return True

    def peer_lost(self, now_s: float, learner: int, candidates: Mapping[int, Candidate], regions: Mapping[int, str]) -> list:
        """``learner`` went away: as a recipient its recovery ends; as a donor, the next one is asked."""
        self.pending.pop(learner, None)
        actions: list = []
        for r, p in list(self.pending.items()):
            if p.donor == learner:
                self.replaced += 1
                actions += self._ask(now_s, r, p.versions, candidates, regions.get(r, ""), p.tried)
        return actions

    def tick(self, now_s: float, candidates: Mapping[int, Candidate], regions: Mapping[int, str]) -> list:
        """Donors that did not deliver within ``timeout_s`` are replaced by the next one."""
        actions: list = []
        for r, p in list(self.pending.items()):
            if now_s - p.asked_s > self.timeout_s:
                self.replaced += 1
                actions += self._ask(now_s, r, p.versions, candidates, regions.get(r, ""), p.tried)
        return actions
