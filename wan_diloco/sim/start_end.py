"""A simulated run's start barrier and its final sync's verdict, through the core pieces the runtime uses.

- The start barrier (``core.barrier``): the syncer's ``StartBarrier`` counts a learner as joined at its
  first metadata (its hello: at t = 0, or when a late learner comes up); every learner holds a
  ``BarrierView`` of what the syncer last said and takes no step before it says ``started``. So with
  ``run.min_learners_to_start`` = M a late learner holds everyone back until it joins, as in a real run,
  and a barrier not met within ``run.start_timeout_s`` fails the run (``FailRun``: ``RunFailed``). The
  handshake takes no virtual time, as the join at the start does not (a barrier of one learner, the
  default, changes nothing).
- The final sync (``core.final_sync``): after the final merge each learner that is up fetches the
  syncer's final fragments; ``FinalSync`` says whether it must rejoin first, which fragments it installs
  from the fetched finals (their broadcast did not reach it) and its verdict: the fragments whose digest
  differs from the syncer's. ``SimResult.final_sync`` holds each learner's.
"""
from __future__ import annotations

from wan_diloco.assemble import fragment_digest
from wan_diloco.core.final_sync import Final, FinalSync
from wan_diloco.sim.effects import SyncerFx

BARRIER_CHECK_S = 1e-6  # the barrier expires strictly after its timeout: check just past it


class RunFailed(RuntimeError):
    """The simulated run failed as a real one would (the one line it ends with)."""


class StartAndEnd:
    """``Simulation``'s start barrier and final verdict (a mixin: it uses its learners, syncer and clock)."""

    def _hello(self, m: int) -> None:
        """Learner ``m`` holds Θ and says so (its first metadata): the barrier counts it; it steps once started."""
        if self.barrier.opened_s is None:
            self._at(self.now + self.barrier.timeout_s + BARRIER_CHECK_S, self._barrier_tick)
        self._barrier_actions(self.barrier.on_metadata(self.now, m))
        self._start_step(m)

    def _barrier_tick(self) -> None:
        self._barrier_actions(self.barrier.on_tick(self.now))

    def _barrier_actions(self, actions: list) -> None:
        SyncerFx(self).run(actions)

    def announce_barrier(self, status: dict, met: bool) -> None:
        """``AnnounceBarrier``: every learner hears the barrier's state; those it held back step once started."""
        for m, l in enumerate(self.learners):
            self.views[m].on_status(status["started"], status["need"], status["joined"], status["waiting_for"])
            if l.at_barrier and not self.views[m].must_wait(self.now):
                l.at_barrier = False
                self._start_step(m)
        if met:
            self.faults.append({"event": "barrier_met", "at_s": self.now, **status})

    def fail(self, why: str) -> None:
        """``FailRun``."""
        raise RunFailed(why)

    def _final_verdicts(self) -> list[dict]:
        """Each learner that is up at the end: its final sync's outcome, as the runtime's ``learner_final``."""
        P = len(self.frags)
        out = []
        for m, l in enumerate(self.learners):
            if not l.up:
                continue
            fs = FinalSync(m, P)
            while True:
                fs.begin()  # ValueError after FINAL_ROUNDS rounds, as the runtime's SyncerLost
                run_id, epoch, resumed_from = self._identity_of_syncer()
                served = [(self.syncer.theta[p], self.syncer.version[p]) for p in range(P)]
                finals = [Final(p, version, epoch, resumed_from) for p, (_, version) in enumerate(served)]
                if not fs.on_finals(l.core.epoch, finals):
                    break
                self._join_now(m)  # served by an incarnation it has not joined: rejoin and sync again
            by_bulk = fs.behind(l.core.version, finals)
            for p in by_bulk:
                self._learner_actions(m, l.core.resync(p, *served[p]))
            names = self.frags
            mismatch = FinalSync.verdict([fragment_digest(served[p][0], names[p]) for p in range(P)],
                                         [fragment_digest(l.core.base[p], names[p]) for p in range(P)])
            out.append({"learner": m, "versions": list(l.core.version), "final_by_bulk": len(by_bulk),
                        "digest_mismatch": mismatch})
        return out
