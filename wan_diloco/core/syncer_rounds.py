"""A syncer's rounds: what one holds, when it closes (quorum, then the grace window), late Δs folded
into the next, the merge and outer step that close it, and the end-of-run sync. ``SyncerRounds`` keeps
the books (versions, clock, stats) around the functions of plain values ahead of it.
"""
from __future__ import annotations

import math
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core.protocol import (
    FINAL_TIMER, SYNCER, Broadcast, Codec, Ema, FragmentUpload, GlobalUpdate, ProtocolError, SetTimer, Tensors,
    encode_or_refuse,
)
from wan_diloco.core.syncer_config import SyncerConfig
from wan_diloco.core.syncer_state import LearnerInfo, SyncerStats
from wan_diloco.fragments import Encoded
from wan_diloco.merge import MergeMethod, Workers, chunks, merge_fragment, sum_squares, token_weights
from wan_diloco.outer import OuterOptimizer

Timing = Callable[[str], AbstractContextManager[Any]]


@dataclass
class Round:
    """One fragment's round for one due step: the Δs in, when each came, its quorum and grace."""
    opened_s: float
    contributions: dict[int, FragmentUpload] = field(default_factory=dict)
    received_s: dict[int, float] = field(default_factory=dict)
    quorum_s: float | None = None
    deadline_s: float | None = None
    grace_s: float = 0.0
    timer_set: bool = False


def fold_carried(rnd: Round, carried: Mapping[int, FragmentUpload], oldest_base: int) -> tuple[int, int]:
    """Late Δs of this fragment joined into ``rnd`` (one learner's with its own Δ there, as one);
    those based before ``oldest_base`` dropped. Returns (carried, dropped as stale)."""
    taken = stale = 0
    for m, msg in carried.items():
        if msg.base_version < oldest_base:
            stale += 1
            continue
        taken += 1
        mine = rnd.contributions.get(m)
        rnd.contributions[m] = msg if mine is None else combine(msg, mine)
    return taken, stale


def merged_delta(ups: Sequence[FragmentUpload], method: MergeMethod, is_embedding: Callable[[str], bool],
                 workers: Workers, timing: Timing, gains: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The Δs of one round merged, weighted by tokens (equally where no learner counted any). ``gains``
    (``OuterOptimizer.gains``; None: all 1) scale each Δ's weight and the merged Δ by Σ w·g / Σ w, so
    stale Δs weigh less and a round of only stale ones steps less (docs/method.md)."""
    weights = token_weights([u.c_tokens for u in ups], [u.c_steps for u in ups])
    if weights.sum() <= 0:
        weights = np.ones(len(ups))
    with timing("merge"):
        if gains is None:
            return merge_fragment([u.delta for u in ups], weights, method, is_embedding, workers)
        gained = weights * gains
        merged = merge_fragment([u.delta for u in ups], gained, method, is_embedding, workers)
        shrink = np.float32(gained.sum() / weights.sum())
        return {n: np.multiply(a, shrink, dtype=np.float32) for n, a in merged.items()}


def outer_step(outer: OuterOptimizer, codec: Codec, p: int, theta: Tensors, delta: Mapping[str, np.ndarray],
               workers: Workers, timing: Timing) -> tuple[Encoded, dict[str, np.ndarray], float]:
    """(the encoded update, the new Θ_p, ||new Θ_p||²) for the merged ``delta``; Θ_p and the momentum
    untouched (``outer.commit`` advances it once the round is taken). ProtocolError where the outer
    step came out non-finite: the codec refuses such an update, or Θ_p + update overflowed."""
    with np.errstate(over="ignore", invalid="ignore"), timing("outer_step"):
        update = outer.update(p, delta, workers)
    # Everyone, the syncer included, applies the same decoded update: all copies stay bit-identical.
    # The codec refuses a non-finite update (an outer step that overflowed).
    with timing("encode"):
        enc = encode_or_refuse(codec, update, f"update of fragment {p}")
    # New arrays, not in place: a snapshot being written shares the old ones (``export``).
    new = add(theta, enc.values, workers)
    theta_sq = float(sum_squares(list(new.values()), workers).sum())  # the next norm check's
    if not math.isfinite(theta_sq):
        raise ProtocolError("the outer step overflowed (non-finite result)")
    return enc, new, theta_sq


def finals_complete(finals: Mapping[tuple[int, int], FragmentUpload], owned: Sequence[int],
                    alive: Sequence[int]) -> bool:
    """Every live learner sent its final upload of every fragment this core owns."""
    return all(all((m, p) in finals for p in owned) for m in alive)


def final_rounds(finals: Mapping[tuple[int, int], FragmentUpload], owned: Sequence[int],
                 now_s: float) -> list[tuple[tuple[int, int], Round]]:
    """The end-of-run sync's rounds: per owned fragment with final uploads, one round of all of
    them, keyed by the latest due step among them."""
    rounds = []
    for p in owned:
        ups = [u for (m, q), u in sorted(finals.items()) if q == p]
        if not ups:
            continue
        rnd = Round(opened_s=now_s)
        for u in ups:
            rnd.contributions[u.learner] = u
            rnd.received_s[u.learner] = now_s
        rounds.append(((p, max(u.due_step for u in ups)), rnd))
    return rounds


def combine(a: FragmentUpload, b: FragmentUpload) -> FragmentUpload:
    """One learner's two Δs for a fragment (a late one and a newer one) as one: its whole displacement."""
    return replace(
        b, delta={n: a.delta[n] + b.delta[n] for n in b.delta}, c_steps=a.c_steps + b.c_steps,
        c_tokens=a.c_tokens + b.c_tokens, base_version=min(a.base_version, b.base_version), nbytes=a.nbytes + b.nbytes,
        payload=None,
    )


def add(a: Tensors, b: Tensors, workers: Workers) -> dict[str, np.ndarray]:
    """{n: a[n] + b[n]} in fresh float32 arrays, chunk by chunk on ``workers``."""
    names = list(a)
    xs, ys = [np.ravel(a[n]) for n in names], [np.ravel(b[n]) for n in names]
    out = [np.empty(x.size, np.float32) for x in xs]

    def run(it) -> None:
        i, lo, hi = it
        np.add(xs[i][lo:hi], ys[i][lo:hi], out=out[i][lo:hi])

    with np.errstate(over="ignore", invalid="ignore"):
        workers.map(run, chunks([x.size for x in xs]))
    return {n: o.reshape(np.shape(a[n])) for n, o in zip(names, out)}


class SyncerRounds:
    """The round-keeping half of ``SyncerCore`` (its base class): rounds opened by uploads, closed at
    the quorum plus grace (``_maybe_close``) or once a learner they wait for goes away (``_recheck``),
    each close one merge and outer step (``_close``); and the end-of-run sync. A base class, not an
    object the core holds, because a close moves the core's whole state at once (Θ, versions, clock,
    stats); that state is ``SyncerCore``'s, set in its ``__init__`` and listed here for the reader."""

    cfg: SyncerConfig
    fragments: list[tuple[str, ...]]
    owned: tuple[int, ...]
    is_embedding: Callable[[str], bool]
    codec: Codec
    workers: Workers
    timing: Timing
    outer: OuterOptimizer
    theta: list[dict[str, np.ndarray]]
    theta_sq: list[float | None]
    version: list[int]
    last_closed_due: list[int]
    rounds: dict[tuple[int, int], Round]
    carried: list[dict[int, FragmentUpload]]  # per fragment, per learner
    merged_at: dict[tuple[int, int], int]
    learners: dict[int, LearnerInfo]
    quorum_wait_s: Ema
    global_step: int
    clock: VectorClock
    syncer_ticks: int
    stats: SyncerStats
    notices: deque[str]
    finals: dict[tuple[int, int], FragmentUpload]
    final_started: bool
    final_done: bool
    run_id: str
    epoch: int
    resumed_from: int
    snapshot_id: int

    def alive(self) -> list[int]:
        raise NotImplementedError  # SyncerCore's: the learners not known to be down

    # ---- estimates -------------------------------------------------------------------

    def tau_now(self) -> int:
        """The overlap the grace must respect: the smallest any live learner reported (learners that
        re-plan τ from their links may differ; waiting past the smallest would make its learners
        merge late), else the configured one."""
        taus = [l.tau for l in self.learners.values() if l.alive and l.tau is not None]
        return min(taus) if taus else self.cfg.tau

    def grace_window_s(self) -> float:
        """ξ_grace = γ·max(0, τ·ξ_step − (ξ_quorum + ξ_sync)), all measured online (τ: ``tau_now``)."""
        if not self.cfg.grace:
            return 0.0
        steps = [l.step_s for l in self.learners.values() if l.alive and l.step_s is not None]
        if not steps:
            return 0.0
        syncs = [l.sync_s for l in self.learners.values() if l.alive and l.sync_s is not None]
        step_s = float(np.mean(steps))
        sync_s = float(np.mean(syncs)) if syncs else 0.0
        slack = self.tau_now() * step_s - ((self.quorum_wait_s.value or 0.0) + sync_s)
        grace = self.cfg.grace_safety * max(0.0, slack)
        return grace if self.cfg.max_grace_s is None else min(grace, self.cfg.max_grace_s)

    def quorum(self) -> int:
        """K for the next round: a learner known to be down cannot be waited for (>= 1)."""
        return max(1, min(self.cfg.quorum, len(self.alive())))

    def final_participants(self) -> set[int]:
        return {m for (m, _) in self.finals}

    def _late(self, msgs) -> None:
        """Δs whose round closed without them: carried into the fragment's next merge, or dropped."""
        for msg in msgs:
            if self.cfg.carry_late:
                self._carry(msg)
            else:
                self.stats.late_dropped += 1

    def _carry(self, msg: FragmentUpload) -> None:
        held = self.carried[msg.fragment]
        held[msg.learner] = msg if msg.learner not in held else combine(held[msg.learner], msg)

    def _recheck(self, now_s: float) -> list:
        actions: list = []
        for key in sorted(self.rounds):
            if key in self.rounds:
                actions += self._maybe_close(now_s, key)
        if self.final_started and self._finals_complete():  # the last learner it waited for went away
            actions += self._final_sync(now_s)
        return actions

    def _maybe_close(self, now_s: float, key: tuple[int, int]) -> list:
        rnd = self.rounds[key]
        if len(rnd.contributions) < self.quorum():
            return []
        if rnd.quorum_s is None:
            rnd.quorum_s = now_s
            self.quorum_wait_s.add(now_s - rnd.opened_s)
            rnd.grace_s = self.grace_window_s()
            rnd.deadline_s = now_s + rnd.grace_s
        waiting = [m for m in self.alive() if m not in rnd.contributions]
        if not waiting or now_s >= rnd.deadline_s:
            with self.timing("close"):
                return self._close(now_s, key)
        if not rnd.timer_set:
            rnd.timer_set = True
            return [SetTimer(key, rnd.deadline_s)]
        return []

    def _close(self, now_s: float, key: tuple[int, int], final: bool = False) -> list:
        p, due = key
        rnd = self.rounds.pop(key)
        # Older open rounds of this fragment are now late: their Θ has moved on.
        for old in [k for k in self.rounds if k[0] == p and k[1] < due]:
            self._late(self.rounds.pop(old).contributions.values())
        carried, stale = fold_carried(rnd, self.carried[p], self.version[p] - self.cfg.max_staleness)
        self.stats.late_carried += carried
        self.stats.stale_dropped += stale
        self.carried[p] = {}
        learners = sorted(rnd.contributions)
        ups = [rnd.contributions[m] for m in learners]
        gains = self.outer.gains(p, [self.version[p] - u.base_version for u in ups], [u.delta for u in ups])
        delta = merged_delta(ups, self.cfg.merge, self.is_embedding, self.workers, self.timing, gains)
        try:
            enc, new, theta_sq = outer_step(self.outer, self.codec, p, self.theta[p], delta, self.workers, self.timing)
        except ProtocolError as e:
            # Θ_p and its momentum stay as they were; the learners keep their Δs' steps in θ and send again.
            self.stats.refused_rounds += 1
            self.notices.append(f"merge of fragment {p} (due step {due}, learners {learners}) refused: {e}")
            return []
        with self.timing("outer_step"):
            self.outer.commit(p, delta, self.workers)
        self.theta[p], self.theta_sq[p] = new, theta_sq
        from_version = self.version[p]
        self.version[p] += 1
        self.last_closed_due[p] = max(self.last_closed_due[p], due)
        self.clock = self.clock.tick(SYNCER)
        self.syncer_ticks += 1
        self.stats.fragment_syncs[p] += 1
        for m in learners:
            self.merged_at[(m, p)] = self.version[p]
        self.stats.quorum_sizes.append(len(ups))
        self.stats.grace_s.append(rnd.grace_s)
        self.stats.history.append((now_s, p, due, tuple(learners)))
        self.stats.bytes_out += enc.nbytes
        msg = GlobalUpdate(
            fragment=p, from_version=from_version, to_version=self.version[p], due_step=due,
            global_step=self.global_step, clock=self.clock, update=enc.values, nbytes=enc.nbytes,
            contributors=tuple(learners), held_s={m: now_s - t for m, t in rnd.received_s.items()},
            payload=enc.payload, final=final, run_id=self.run_id, epoch=self.epoch, resumed_from=self.resumed_from,
            snapshot=self.snapshot_id,
        )
        return [Broadcast(msg)]

    # ---- end of run ----------------------------------------------------------------

    def _final_upload(self, now_s: float, msg: FragmentUpload) -> list:
        if self.final_done:
            return []  # too late: the learner takes the final fragments like everyone else
        self.finals[(msg.learner, msg.fragment)] = msg  # a retry overwrites
        actions: list = []
        if not self.final_started:
            self.final_started = True
            actions.append(SetTimer(FINAL_TIMER, now_s + self.cfg.final_timeout_s))
        if self._finals_complete():
            actions += self._final_sync(now_s)
        return actions

    def _finals_complete(self) -> bool:
        return finals_complete(self.finals, self.owned, self.alive())

    def _final_sync(self, now_s: float) -> list:
        """Merge every fragment from all final uploads at once, quorum and grace aside."""
        if self.final_done:
            return []
        self.final_done = True
        for key in list(self.rounds):  # open rounds end unmerged: their learners sent finals instead
            self.rounds.pop(key)
        actions: list = []
        for key, rnd in final_rounds(self.finals, self.owned, now_s):
            self.rounds[key] = rnd
            with self.timing("close"):
                actions += self._close(now_s, key, final=True)
        return actions
