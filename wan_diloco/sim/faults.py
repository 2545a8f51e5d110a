"""The faults of a failure tape (``wan_diloco.tape``) replayed by ``Simulation``, through the same core
code as the network driver:

- a learner killed and restarted: it takes up the syncer's incarnation (``LearnerCore.join``) if the
  syncer resumed meanwhile, then a healthy peer's parameters, inner optimizer, residuals and data
  step (``core.recovery.Donations`` picks the donor; ``LearnerCore.export``/``adopt`` copy the
  protocol state), and replays the updates that arrive while the state travels;
- a learner that joins late (an outage from 0): it never trains before ``up_at``, then recovers as above;
- the syncer (or one shard) killed and resumed: what was sent to it meanwhile is lost, its timers die
  with it; at ``up_at`` a fresh core takes up its newest complete snapshot (``sim.snapshots``) as the
  next incarnation, and each learner that is up meets it as its reconnected update stream would
  (``LearnerCore.meet``) and rejoins (``Rejoin`` -> ``join``), between two steps as the runtime does.

Simplifications, all of time only: the donor's state is taken when it is asked (the runtime waits
until it has seen the versions the recipient saw; the recipient's replay covers the gap), and
snapshot parts take no time to write.
"""
from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.core.recovery import AskDonor, Candidate, NoDonor


def opt_digest(state) -> str:
    """SHA-256 of a train state's inner optimizer (names, dtypes, bytes), as the runtime's ``named_digest``."""
    h = hashlib.sha256()
    named = tree.to_named(state.opt_state, "opt")
    for name in sorted(named):
        a = np.asarray(named[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class FaultReplay:
    """``Simulation``'s fault handlers (a mixin: they use its learners, syncer, clock and event heap)."""

    # ---- learners -------------------------------------------------------------------------

    def _go_down(self, m: int) -> None:
        l = self.learners[m]
        if not (l.up or l.listening):
            return
        l.up, l.listening, l.stepping, l.waiting, l.join_due = False, False, False, False, False
        l.life += 1
        self.faults.append({"event": "learner_down", "learner": m, "at_s": self.now})
        self._syncer_event(self._peer_lost, m)

    def _come_up(self, m: int) -> None:
        l = self.learners[m]
        if l.up:
            return
        l.life += 1
        run_id, epoch, resumed_from = self._identity_of_syncer()
        if l.core.epoch and epoch != l.core.epoch:  # the syncer resumed while it was down: its model first
            self._join_now(m)
        candidates = {i: Candidate(p.core.region, p.core.step) for i, p in enumerate(self.learners)
                      if p.up and p is not l}
        ready = self.now + self.cfg.rtt_s
        for a in self.donations.request(self.now, m, tuple(self.syncer.version), candidates, l.core.region):
            match a:
                case AskDonor(donor=d, recipient=r):
                    # Copy the donor (its state takes state_bytes over the link): parameters, inner optimizer and
                    # schedule position as one train state, the protocol state through the core.
                    peer = self.learners[d]
                    l.state = peer.state
                    l.core.adopt(*peer.core.export())
                    self.donations.delivered(r, d)
                    ready = self.now + self.state_bytes * 8 / (self.cfg.bandwidth_gbit_s * 1e9) + self.cfg.rtt_s
                    self.faults.append({"event": "recovered", "learner": r, "donor": d, "at_s": self.now,
                                        "step": l.core.step, "opt_digest": opt_digest(l.state),
                                        "donor_opt_digest": opt_digest(peer.state)})
                case NoDonor(recipient=r, why=why):
                    for p in range(len(self.frags)):
                        self._learner_actions(r, l.core.resync(p, self.syncer.theta[p], self.syncer.version[p]))
                    self.faults.append({"event": "no_donor", "learner": r, "at_s": self.now, "why": why})
                case _:
                    raise TypeError(f"simulator: unhandled recovery action {a!r}")
        # Global updates sent while the state travels are applied in order on top of it (docs/method.md, "Recovery",
        # step 4), so the learner starts current instead of resyncing fragment by fragment.
        l.listening = True
        self._at(ready, self._rejoin, m, l.life)

    def _rejoin(self, m: int, life: int) -> None:
        l = self.learners[m]
        if life != l.life:
            return
        l.up = True
        self.faults.append({"event": "learner_up", "learner": m, "at_s": self.now, "step": l.core.step})
        self._start_step(m)

    def _save_part(self, m: int, snapshot: int) -> None:
        """``SaveState``: the learner's part of ``snapshot`` (the core's protocol state, its train state, data
        position and tokens), kept in memory; the syncer hears of it in the learner's next metadata."""
        l = self.learners[m]
        self.learner_parts[m] = (snapshot, {"core": l.core.export(), "state": l.state, "data": l.batches.position()})
        l.core.saved(snapshot)

    # ---- the syncer ---------------------------------------------------------------------------

    def _shards_of(self, shard: int | None) -> list[int]:
        return list(range(self.spec.syncer.shards)) if shard is None else [shard]

    def _identity_of_syncer(self) -> tuple[str, int, int]:
        """(run id, incarnation, resumed from) as the learners see the syncer (one view over its shards)."""
        return self.syncer.run_id, self.syncer.epoch, self.syncer.resumed_from

    def _syncer_down(self, shard: int | None) -> None:
        for s in self._shards_of(shard):
            self.syncer_life[s] += 1
            self.syncer_up[s] = False
            if self.sharded:
                self.syncer.down(s)
            self.faults.append({"event": "syncer_down", "shard": s, "at_s": self.now})

    def _syncer_resume(self, shard: int | None) -> None:
        for s in self._shards_of(shard):
            if self.syncer_up[s]:
                continue
            fresh = self.parts.syncer_core(shard=s if self.sharded and self.spec.syncer.shards > 1 else None)
            snap = self.keepers[s].resume(self.now, fresh)
            self.syncer_life[s] += 1
            self.syncer_up[s] = True
            if self.sharded:
                self.syncer.resumed(s, fresh)
            else:
                self.syncer = fresh
            # No liveness ticks here: the learners down now are declared lost at once, as at their failure.
            for m, l in enumerate(self.learners):
                if not (l.up or l.listening):
                    fresh.on_peer_lost(self.now, m)
            self.faults.append({"event": "syncer_resumed", "shard": s, "at_s": self.now, "snapshot": snap,
                                "epoch": fresh.epoch, "versions": list(fresh.version)})
        for m, l in enumerate(self.learners):  # each update stream reconnects and hears the syncer's identity
            if l.listening:
                self._at(self.now + self.cfg.rtt_s / 2, self._meet, m, l.life)

    def _meet(self, m: int, life: int) -> None:
        l = self.learners[m]
        if life != l.life or not l.listening:
            return
        if l.core.meet(*self._identity_of_syncer()) == "new":
            self._fetch_for_join(m)

    def _fetch_for_join(self, m: int) -> None:
        """``Rejoin``: fetch every global fragment (over the learner's down link), then ``join`` between steps."""
        l = self.learners[m]
        if l.joining:
            return
        l.joining = True
        nbytes = sum(self.parts.layout.nbytes)
        self.bytes_sent += nbytes
        self._at(l.down_link.send(self.now, nbytes), self._fetched, m, l.life)

    def _fetched(self, m: int, life: int) -> None:
        l = self.learners[m]
        if life != l.life:
            return
        l.joining = False
        if l.stepping:
            l.join_due = True  # the runtime joins from its inbox, between two steps
        else:
            self._join_now(m)

    def _join_now(self, m: int) -> None:
        l = self.learners[m]
        l.join_due = False
        run_id, epoch, resumed_from = self._identity_of_syncer()
        fragments = [(self.syncer.theta[p], self.syncer.version[p]) for p in range(len(self.frags))]
        global_step = max(c.global_step for c in self._cores())
        self._learner_actions(m, l.core.join(run_id, epoch, resumed_from, fragments, global_step))
        # As the runtime's ``_take_up_step``: the step counter and the learning-rate schedule follow the run.
        if l.core.step > int(l.state.step):
            l.state = l.state.replace(step=jnp.asarray(l.core.step, jnp.int32))
        if l.core.step > int(train_lib.schedule_step(l.state)):
            l.state = train_lib.set_schedule_step(l.state, l.core.step)
        self.faults.append({"event": "rejoined", "learner": m, "at_s": self.now, "epoch": epoch,
                            "resumed_from": resumed_from, "step": l.core.step})
        self._resume_if_unblocked(m)

    def _cores(self) -> list:
        return self.syncer.cores if self.sharded else [self.syncer]
