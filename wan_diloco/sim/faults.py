"""The faults of a failure tape (``wan_diloco.tape``) replayed by ``Simulation``, through the same core
code as the network driver:

- a learner killed and restarted (with ``--resume``, as the chaos driver does): it takes up the syncer's
  incarnation (``LearnerCore.join``) if the syncer resumed meanwhile, then its own state as
  ``core.restore.Resume`` says (``sim.resume``): its part of the snapshot the syncer resumed from, else
  the data position the syncer kept and a healthy peer's parameters, inner optimizer and residuals;
  and replays the updates that arrive while the state travels;
- a learner that joins late (an outage from 0): it never trains before ``up_at``, then recovers as above;
- the syncer (or one shard) killed and resumed: while it runs it cuts snapshots and announces each to the
  learners over their down links (``SnapshotCut``); what was sent to it while down is lost, its timers die
  with it; at ``up_at`` a fresh core takes up its newest complete snapshot (``sim.snapshots``) as the
  next incarnation, and each learner that is up meets it as its reconnected update stream would
  (``LearnerCore.meet``) and rejoins (``Rejoin`` -> ``join``), between two steps as the runtime does.
"""
from __future__ import annotations

import jax.numpy as jnp

from wan_diloco import train as train_lib
from wan_diloco.core.peer import Donor
from wan_diloco.core.rejoin import rejoin_fragments, take_up_step


class FaultReplay:
    """``Simulation``'s fault handlers (a mixin: they use its learners, syncer, clock and event heap)."""

    # ---- learners -------------------------------------------------------------------------

    def _go_down(self, m: int) -> None:
        l = self.learners[m]
        if not (l.up or l.listening):
            return
        l.up, l.listening, l.stepping, l.waiting, l.join_due = False, False, False, False, False
        l.life += 1
        l.recovery, l.donor = None, Donor(m)  # what its process held goes with it
        self.faults.append({"event": "learner_down", "learner": m, "at_s": self.now})
        self._syncer_event(self._peer_lost, m)

    def _come_up(self, m: int) -> None:
        l = self.learners[m]
        if l.up:
            return
        l.life += 1
        # Simplified: it keeps the train state and protocol state it died with, taking up the syncer's model
        # only if the syncer resumed meanwhile, then what ``_restart`` takes up replaces them (a real restart
        # starts from a fresh optimizer and a join: they differ only where nothing is taken up).
        epoch = self._identity_of_syncer()[1]
        if l.core.epoch and epoch != l.core.epoch:
            self._join_now(m, "joined")
        l.ready_s = self.now + self.cfg.rtt_s
        self._restart(m)
        # Global updates sent while a peer's state travels are applied in order on top of it (docs/method.md,
        # "Recovery", step 4), so the learner starts current instead of resyncing fragment by fragment.
        l.listening = True
        if l.recovery is None:  # else it trains again once the request ended (``sim.donations``)
            self._at(l.ready_s, self._rejoin, m, l.life)

    def _rejoin(self, m: int, life: int) -> None:
        l = self.learners[m]
        if life != l.life:
            return
        l.up = True
        self.faults.append({"event": "learner_up", "learner": m, "at_s": self.now, "step": l.core.step})
        if m in self.barrier.joined:
            self._start_step(m)
        else:
            self._hello(m)  # a late learner's first metadata: its join at the start barrier

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
            if s == 0:
                self._drop_recoveries()
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
        """``Rejoin``: fetch the global fragments (over the learner's down link; with shards, only those of
        the shards that resumed: ``ShardView.refetch``), then ``join`` between steps."""
        l = self.learners[m]
        if l.joining:
            return
        l.joining = True
        l.refetch = self.syncer.view.refetch(l.core.epoch) if self.sharded else list(range(len(self.frags)))
        nbytes = sum(self.parts.layout.nbytes[p] for p in l.refetch)
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
            self._join_now(m, fetched=l.refetch)

    def _join_now(self, m: int, event: str = "rejoined", fetched: list[int] | None = None) -> None:
        """Join the syncer with the global fragments ``fetched`` (None: every one) and its own copies of the rest."""
        l = self.learners[m]
        l.join_due = False
        run_id, epoch, resumed_from = self._identity_of_syncer()
        if fetched is None or not self.sharded:
            fetched = list(range(len(self.frags)))
        else:  # another shard resumed while they travelled: its fragments too (their time is not modelled)
            more = [p for p in self.syncer.view.refetch(l.core.epoch) if p not in fetched]
            self.bytes_sent += sum(self.parts.layout.nbytes[p] for p in more)
            fetched = sorted([*fetched, *more])
        fragments = rejoin_fragments({p: (self.syncer.theta[p], self.syncer.version[p]) for p in fetched},
                                     l.core.base, l.core.version)
        global_step = max(c.global_step for c in self._cores())
        self._learner_actions(m, l.core.join(run_id, epoch, resumed_from, fragments, global_step))
        self._take_up_step(m)
        self.faults.append({"event": event, "learner": m, "at_s": self.now, "epoch": epoch,
                            "resumed_from": resumed_from, "step": l.core.step, "fetched": fetched})
        self._resume_if_unblocked(m)

    def _announce_cut(self, now_s: float, cut) -> None:
        """The syncer (shard 0) cut a snapshot: each listening learner hears of it over its down link, after
        what is queued there, as on the update stream."""
        if self.sharded:
            cut = self.syncer.view.cut(0, cut)
        for m, l in enumerate(self.learners):
            if l.listening:
                self._at(l.down_link.send(now_s, 0), self._deliver_cut, m, l.life, cut)

    def _deliver_cut(self, m: int, life: int, cut) -> None:
        l = self.learners[m]
        if l.listening and life == l.life:
            self._learner_actions(m, l.core.on_snapshot_cut(self.now, cut))

    def _take_up_step(self, m: int) -> None:
        """As the runtime's ``take_up_step``: the step counter and the learning-rate schedule follow the run."""
        l = self.learners[m]
        train_step, schedule_step = take_up_step(l.core.step, int(l.state.step), int(train_lib.schedule_step(l.state)))
        if train_step is not None:
            l.state = l.state.replace(step=jnp.asarray(train_step, jnp.int32))
        if schedule_step is not None:
            l.state = train_lib.set_schedule_step(l.state, schedule_step)

    def _cores(self) -> list:
        return self.syncer.cores if self.sharded else [self.syncer]
