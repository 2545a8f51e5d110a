"""The decoupled (and streaming / DiLoCo) simulation: events on a virtual clock around the sans-IO cores.

Per-learner step time = base × speed factor × lognormal noise; per-link
transfer time = bytes / bandwidth + RTT/2, with each link a FIFO, so τ and the
grace window matter. Learners, the syncer and its shards go down and come back by a failure tape
(``wan_diloco.tape``; how each fault is replayed: ``sim.faults``). Each action of a core is carried
out through ``core.effects``' one dispatch per side, with the simulator's effects (``sim.effects``).
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from wan_diloco import data as data_lib
from wan_diloco import model as model_lib
from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.assemble import Assembly
from wan_diloco.core import FINAL_TIMER, LearnerCore
from wan_diloco.core.barrier import BarrierView, StartBarrier, barrier_need
from wan_diloco.core.evals import due_point
from wan_diloco.core.peer import Donor, position_field
from wan_diloco.core.positions import MAX_POSITION_CHARS, Positions
from wan_diloco.planning.shards import shard_merge_rate
from wan_diloco.sim.common import Progress, SimResult, step_time, uptime
from wan_diloco.sim.effects import LearnerFx, SimEffects, SyncerFx
from wan_diloco.sim.donations import PeerRecovery, Recovering
from wan_diloco.sim.faults import FaultReplay
from wan_diloco.sim.resume import ResumeReplay
from wan_diloco.sim.start_end import StartAndEnd
from wan_diloco.sim.shards import ShardedSyncer
from wan_diloco.sim.snapshots import SnapshotKeeper
from wan_diloco.tape import Fault, Outage, SyncerOutage
from wan_diloco.spec import RunSpec, to_document


class _Link:
    """One direction of a learner <-> syncer link: FIFO, bandwidth then half the RTT."""

    def __init__(self, gbit_s: float, rtt_s: float):
        self.bytes_per_s = gbit_s * 1e9 / 8
        self.half_rtt_s = rtt_s / 2
        self.free_at_s = 0.0

    def send(self, now_s: float, nbytes: int) -> float:
        start = max(now_s, self.free_at_s)
        self.free_at_s = start + nbytes / self.bytes_per_s
        return self.free_at_s + self.half_rtt_s


@dataclass
class _Learner:
    core: LearnerCore
    state: Any
    batches: data_lib.FailoverBatches
    rng: np.random.Generator
    speed: float
    up_link: _Link
    down_link: _Link
    up: bool = True
    listening: bool = True  # receives global updates: up, or recovering (docs/method.md, "Recovery": they are replayed)
    stepping: bool = False
    waiting: bool = False
    life: int = 0  # bumped on failure and restart: events of a dead life of this learner are ignored
    joining: bool = False  # fetching the fragments of a resumed syncer (``Rejoin``)
    join_due: bool = False  # they arrived during a step: ``join`` after it
    refetch: list[int] = field(default_factory=list)  # the fragments that rejoin fetches
    useful_s: float = 0.0
    tokens: int = 0  # trained by this learner (its snapshot parts hold it)
    position_known: bool = True  # False while it restarts: its metadata carries no data position then
    ready_s: float = 0.0  # when a restarting learner holds its state and trains again
    at_barrier: bool = False  # waits for the start barrier (``sim.start_end``)
    donor: Donor | None = None  # the states it was asked for (``sim.donations``)
    recovery: Recovering | None = None  # its request for a peer's state while one is in progress
    intervals: list[tuple[float, float]] = field(default_factory=list)
    resume: Any = None  # its ``core.restore.Resume`` since its latest restart (``sim.resume``)



class Simulation(FaultReplay, ResumeReplay, StartAndEnd, SimEffects, PeerRecovery):
    """One simulated run of ``spec`` (already set for its baseline: ``sim.protocol_for``) under the faults of
    a tape. ``faults`` records what each fault did (learner down/up, recovered from which donor, syncer
    resumed from which snapshot at which incarnation, learners rejoined)."""

    def __init__(self, spec: RunSpec, parts: Assembly, outages: list[Fault], progress: Progress | None = None,
                 on_upload: Callable | None = None):
        self.spec, self.parts, self.progress, self.on_upload = spec, parts, progress, on_upload
        self.cfg = spec.simulate
        self.M = spec.run.learners
        self.frags = parts.layout.fragments
        S = spec.syncer.shards
        merge_gb_s = shard_merge_rate(spec.plan.shard_merge_gb_s, self.M)[0] if self.cfg.merge_takes_time else 0.0
        self.sharded = S > 1 or bool(merge_gb_s)
        if self.sharded:
            cores = [parts.syncer_core(shard=s if S > 1 else None) for s in range(S)]
            self.syncer = ShardedSyncer(cores, parts.shard_plan, list(parts.layout.nbytes), merge_gb_s)
        else:
            self.syncer = parts.syncer_core()
        self.syncer_up = [True] * S
        self.syncer_life = [0] * S  # bumped when a shard dies and resumes: its timers die with it
        # Snapshots are cut only when the tape kills the syncer: nothing else reads them here.
        kills = any(isinstance(o, SyncerOutage) for o in outages)
        every = spec.checkpoint.every_merges
        patience_s = 2 * spec.syncer.liveness_timeout_s  # as the network driver's
        # Shard 0's (its snapshots hold them): the start barrier, the learners' data positions as of their
        # latest metadata.
        self.barrier = StartBarrier(barrier_need(spec.run.min_learners_to_start, self.M), self.M,
                                    spec.run.start_timeout_s)
        self.positions = Positions(self.M)
        self.keepers = [SnapshotKeeper(core, every, s == 0, self.M, patience_s,
                                       *((self.barrier, self.positions, self._announce_cut) if s == 0 else ()))
                        for s, core in enumerate(self._cores())] if kills else []
        self.learner_parts: dict[int, dict[int, tuple[dict, dict]]] = {}  # learner -> snapshot -> its part
        self.donations = self._new_donations()
        self.donation_tick_due = False
        self.views = [BarrierView(spec.run.start_timeout_s) for _ in range(self.M)]
        self.faults: list[dict] = []
        rtt, bw = self.cfg.rtt_s, self.cfg.bandwidth_gbit_s
        self.learners = [
            _Learner(
                core=parts.learner_core(m), state=parts.state0, batches=parts.batches(m),
                rng=np.random.default_rng([spec.run.seed, m]),
                speed=self.cfg.speeds[m] if self.cfg.speeds else 1.0, up_link=_Link(bw, rtt), down_link=_Link(bw, rtt),
                donor=Donor(m),
            )
            for m in range(self.M)
        ]
        self.state_bytes = sum(a.nbytes for a in parts.flat0.values()) * 3  # params + two Adam moments
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.tokens = 0
        self.bytes_sent = 0
        self.done = False
        self.curve: list[dict] = []
        self.eval_step = 0  # the global step of the latest eval point
        self.late = set()  # learners that join late: down from the start, they draw no batch before
        for o in outages:
            match o:
                case Outage(learner=m):
                    self._at(o.down_at, self._go_down, m)
                    self._at(o.up_at, self._come_up, m)
                    if o.joins_late:
                        self.late.add(m)
                case SyncerOutage(shard=shard):
                    self._at(o.down_at, self._syncer_down, shard)
                    self._at(o.up_at, self._syncer_resume, shard)
                case _:
                    raise TypeError(f"simulator: unknown fault {o!r}")

    # ---- event plumbing -------------------------------------------------------------

    def _at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self.heap, (t, self.seq, fn, args))
        self.seq += 1

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self._eval_point(force=True)
        for m in range(self.M):
            if m not in self.late:
                self._hello(m)
        while self.heap and not self.done:
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        if not self.done:
            raise RuntimeError("simulation stalled: every learner is down or blocked and nothing is in flight")
        self._final_sync()
        verdicts = self._final_verdicts()
        self._eval_point(force=True)
        end = self.now
        busy = [iv for l in self.learners for iv in l.intervals]
        st = self.syncer.stats
        return SimResult(
            config=to_document(self.spec), initial_eval_loss=self.curve[0]["eval_loss"],
            final_eval_loss=self.curve[-1]["eval_loss"], tokens=self.tokens,
            goodput=sum(l.useful_s for l in self.learners) / (self.M * end),
            uptime=uptime(busy, end), fragment_syncs=list(st.fragment_syncs), bytes_sent=self.bytes_sent,
            global_steps=self._global_step(), virtual_time_s=end, wall_s=time.perf_counter() - t0,
            curve=self.curve, late_dropped=st.late_dropped, late_carried=st.late_carried,
            mean_quorum=float(np.mean(st.quorum_sizes)) if st.quorum_sizes else 0.0,
            mean_grace_s=float(np.mean(st.grace_s)) if st.grace_s else 0.0,
            params_count=model_lib.param_count(self.parts.state0.params), params=self.syncer.global_params(),
            final_sync=verdicts,
        )

    def _global_step(self) -> int:
        return max(l.core.step for l in self.learners)

    def _finished(self) -> bool:
        if self.cfg.tokens:
            return self.tokens >= self.cfg.tokens
        return self._global_step() >= self.spec.run.steps

    def _eval_point(self, force: bool = False) -> None:
        """An eval point when one is due; the progress callback hears of every step (the bar moves per
        step, with the latest eval loss)."""
        step = self._global_step()
        if force or due_point(self.eval_step, step, self.cfg.curve_every_steps) is not None:
            self.eval_step = step
            params = tree.unflatten(self.syncer.global_params(), self.parts.state0.params)
            point = {"step": step, "tokens": self.tokens, "time_s": self.now, "eval_loss": self.parts.evaluate(params)}
            if not self.curve or point != self.curve[-1]:
                self.curve.append(point)
        if self.progress:
            budget = self.cfg.tokens or self.spec.run.steps
            last = self.curve[-1]  # the latest eval point, taken at its own step
            self.progress(min(1.0, (self.tokens if self.cfg.tokens else step) / budget),
                          {**last, "eval_step": last["step"], "step": step})

    # ---- learners -------------------------------------------------------------------

    def _start_step(self, m: int) -> None:
        l = self.learners[m]
        if self.done or not l.up or l.stepping:
            return
        if self.views[m].must_wait(self.now):
            l.at_barrier = True
            return
        if l.core.blocked:
            l.waiting = True
            return
        down = frozenset(i for i, p in enumerate(self.learners) if not p.up) if self.cfg.data_failover else frozenset()
        batch = l.batches.next(down)
        if self.cfg.tokens:
            # A token budget: the schedule follows the run's tokens, as data parallel's would, so
            # live learners do not run off the end of it while others are down.
            l.state = train_lib.set_schedule_step(l.state, self.tokens // self.parts.tokens_per_step)
        l.state, _ = self.parts.step_fn(l.state, batch.tokens)
        dt = step_time(self.cfg, l.speed, l.rng)
        l.core.begin_step(self.now)
        l.stepping = True
        self._at(self.now + dt, self._end_step, m, l.life, batch.n_tokens, dt)

    def _end_step(self, m: int, life: int, n_tokens: int, dt: float) -> None:
        l = self.learners[m]
        if life != l.life:
            return  # the learner failed during this step: its work is lost
        l.stepping = False
        l.useful_s += dt
        l.intervals.append((self.now - dt, self.now))
        self.tokens += n_tokens
        l.tokens += n_tokens
        self._learner_actions(m, l.core.step_done(self.now, n_tokens))
        self._serve_donations(m)
        if l.join_due:
            self._join_now(m, fetched=l.refetch)
        self._eval_point()
        if self._finished():
            self.done = True
            return
        self._start_step(m)

    def _learner_actions(self, m: int, actions: list) -> None:
        LearnerFx(self, m).run(actions)

    def _deliver(self, m: int, life: int, msg) -> None:
        l = self.learners[m]
        if not l.listening or life != l.life:
            return
        if l.recovery is not None:  # replayed on top of the peer's state once it is installed
            l.recovery.buffered.append(msg)
            return
        self._learner_actions(m, l.core.on_update(self.now, msg))
        if not l.stepping:
            self._serve_donations(m)
        self._resume_if_unblocked(m)

    def _resume_if_unblocked(self, m: int) -> None:
        l = self.learners[m]
        if l.up and l.waiting and not l.core.blocked:
            l.waiting = False
            self._start_step(m)

    # ---- syncer ---------------------------------------------------------------------

    def _from_learner(self, m: int, life: int, handler: Callable, msg) -> None:
        # A learner's failure resets its connection: what it had in flight is lost with it. Delivered
        # after the syncer was told it is down, a message would make it look alive again, and every
        # round would wait out the grace window for it until it came back.
        if life == self.learners[m].life:
            self._syncer_event(handler, msg)

    def _syncer_event(self, handler: Callable, msg) -> None:
        if not self.sharded and not self.syncer_up[0]:
            return  # the syncer is dead: what reaches it is lost (a shard's: ``ShardedSyncer``)
        self._syncer_actions(handler(self.now, msg))

    # The handlers look the syncer up when the event arrives: a resumed one replaces the dead one.

    def _with_position(self, m: int, msg):
        """Metadata with the learner's data position, as the runtime's ``Learner.send_metadata``."""
        l = self.learners[m]
        return dataclasses.replace(msg, data=position_field(l.batches.position() if l.position_known else None,
                                                            MAX_POSITION_CHARS))

    def _metadata(self, now_s: float, msg) -> list:
        actions = self.syncer.on_metadata(now_s, msg)
        if self.syncer_up[0]:
            self.positions.on_metadata(now_s, msg.learner, msg.data)
        if self.keepers and self.syncer_up[0]:  # the learners' parts are in shard 0's snapshots
            epoch = self.syncer.epoch_at(0, msg.epoch) if self.sharded else msg.epoch
            SyncerFx(self, self.keepers[0]).run(self.keepers[0].on_metadata(now_s, msg.learner, msg.snapshot, epoch))
        self._recovering_or_not(now_s, msg)
        return actions

    def _upload(self, now_s: float, msg) -> list:
        if self.on_upload is not None:
            self.on_upload(msg)
        return self.syncer.on_fragment(now_s, msg)

    def _peer_lost(self, now_s: float, m: int) -> list:
        actions = self.syncer.on_peer_lost(now_s, m)
        self._donor_or_recipient_lost(now_s, m)
        for s, keeper in enumerate(self.keepers):
            if self.syncer_up[s]:
                SyncerFx(self, keeper).run(keeper.check(now_s))
        return actions

    def _timer(self, shard: int, life: int, key) -> None:
        if life == self.syncer_life[shard]:  # a dead incarnation's timers die with it
            self._syncer_event(lambda now_s, k: self.syncer.on_timer(now_s, k), key)

    def _syncer_actions(self, actions: list) -> None:
        SyncerFx(self).run(actions)
        for s, keeper in enumerate(self.keepers):  # the runtime cuts after the actions of a merge
            if actions and self.syncer_up[s]:
                SyncerFx(self, keeper).run(keeper.on_merged(self.now))

    def _final_sync(self) -> None:
        """Every live learner sends every fragment at once; the syncer merges them all (a real run's last step)."""
        if not all(self.syncer_up):  # killed to the end: the operator resumes it, and the learners rejoin it
            self._syncer_resume(None)
            for m, l in enumerate(self.learners):
                if l.up and l.core.meet(*self._identity_of_syncer()) == "new":
                    self._join_now(m)
        up = [m for m, l in enumerate(self.learners) if l.up]
        for m in up:  # as in a real run, the syncer has heard from every learner that is up
            self._syncer_event(self._metadata, self._with_position(m, self.learners[m].core.metadata()))
        for m in up:
            self.learners[m].stepping = False  # a step cut short by the end of the run: its buffered updates still merge
            self._learner_actions(m, self.learners[m].core.finish())
        if not self.syncer.final_done:  # someone the syncer still counts as alive is recovering: do not wait
            self._syncer_event(lambda now_s, k: self.syncer.on_timer(now_s, k), FINAL_TIMER)
