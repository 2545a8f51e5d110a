"""Sans-IO final sync, the learner's side (docs/method.md, "End of a run").

After its last step a learner uploads every fragment flagged final (``LearnerCore.finish``) and
fetches the syncer's final fragments (``ObjectRequest("final", p)``, every p). A failed fetch is
asked again (a learner that gives up loses the run). Finals served by a syncer incarnation this
learner has not joined mean the syncer resumed from a snapshot meanwhile and dropped the uploads:
rejoin it and sync again, a few rounds at most. The final merge normally arrives by broadcast;
what has not arrived after a grace is installed from the fetched finals. The verdict: the fragments
whose digest differs from the syncer's (a learner whose model drifted must not pass as done).
"""
from __future__ import annotations

from dataclasses import dataclass

from wan_diloco.core.protocol import ObjectRequest, Rejoin
from wan_diloco.core.reports import Report, warning

FINAL_ROUNDS = 3  # final syncs before the learner gives up on a syncer that keeps changing incarnation
FETCH_TRIES = 3  # fetches of one final fragment
BROADCAST_GRACE_S = 5.0  # how long the final merge's broadcast may take before the finals are installed


@dataclass(frozen=True)
class Final:
    """What the syncer served as its final fragment ``fragment`` (the tensors stay with the driver)."""

    fragment: int
    version: int
    epoch: int
    resumed_from: int


class FinalSync:
    """One learner's final sync: its rounds, its fetches and its verdict."""

    def __init__(self, learner: int, num_fragments: int):
        self.m, self.P = learner, num_fragments
        self.rounds = 0

    def begin(self) -> list[str]:
        """A round starts: the names of the objects to fetch (every final fragment). ``ValueError`` after
        ``FINAL_ROUNDS`` rounds (the syncer changed incarnation during each)."""
        if self.rounds >= FINAL_ROUNDS:
            raise ValueError(f"learner {self.m}: the syncer changed incarnation during each of {FINAL_ROUNDS} final syncs")
        self.rounds += 1
        return [ObjectRequest("final", p).name for p in range(self.P)]

    def on_fetch_failed(self, fragment: int, attempt: int, why: str) -> Report | None:
        """The ``attempt``-th fetch of final fragment ``fragment`` failed: a Report and a fetch again, or None
        (the last try: the failure ends the run)."""
        if attempt >= FETCH_TRIES:
            return None
        return warning(self.m, f"fetch of final fragment {fragment} failed (try {attempt} of {FETCH_TRIES}): {why}")

    def on_finals(self, epoch: int, finals: list[Final]) -> list[Rejoin]:
        """The finals fetched, while this learner follows incarnation ``epoch``: [Rejoin] if an incarnation it
        has not joined served them (sync again after the rejoin), else []."""
        if any(f.epoch != epoch for f in finals):
            return [Rejoin(finals[0].epoch, finals[0].resumed_from)]
        return []

    @staticmethod
    def behind(versions: list[int], finals: list[Final]) -> list[int]:
        """The fragments whose final version this learner has not merged yet (their broadcast is late)."""
        return [f.fragment for f in finals if versions[f.fragment] < f.version]

    @staticmethod
    def verdict(served: list[str], held: list[str]) -> list[int]:
        """The fragments whose digest as served differs from this learner's global view's."""
        return [p for p, (a, b) in enumerate(zip(served, held, strict=True)) if a != b]
