"""A syncer's rounds: what one holds, when it closes (quorum, then the grace window), late Δs folded
into the next, the merge and outer step that close it, and the end-of-run sync. ``SyncerRounds`` keeps
the books (versions, clock, stats) around the functions of plain values ahead of it.

A round merges as its Δs arrive (``merge.Accumulator``): each is folded into the round's running sums
and dropped, so a round holds one fragment of sums whatever M. Where the method needs a Δ whole, it is
held until the close: a learner's Δ while a late Δ of the same learner waits in the carry (the two merge
as one Δ, whose norm RDA needs). docs/method.md, "Merging as Δs arrive", has what this changes.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core.protocol import (
    FINAL_TIMER, SYNCER, Broadcast, Codec, Ema, FragmentUpload, GlobalUpdate, ProtocolError, SetTimer,
)
from wan_diloco.core.close_step import close_step
from wan_diloco.core.syncer_config import SyncerConfig
from wan_diloco.core.syncer_state import LearnerInfo, SyncerStats
from wan_diloco.merge import Accumulator, Workers, token_weights
from wan_diloco.outer import OuterOptimizer

Timing = Callable[[str], AbstractContextManager[Any]]


@dataclass
class Round:
    """One fragment's round for one due step: the Δs in, when each came, its quorum and grace.
    ``contributions``: every learner's upload in it, its Δ emptied once folded into ``sums`` (the
    running merge); those in ``held`` keep theirs until the close."""
    opened_s: float
    contributions: dict[int, FragmentUpload] = field(default_factory=dict)
    sums: Accumulator | None = None
    held: set[int] = field(default_factory=set)
    received_s: dict[int, float] = field(default_factory=dict)
    quorum_s: float | None = None
    deadline_s: float | None = None
    grace_s: float = 0.0
    timer_set: bool = False


def upload_weight(u: FragmentUpload) -> float:
    """A Δ's merge weight: tokens times tokens per step (``merge.token_weights``); a round where every
    weight is 0 weighs its Δs equally (``Accumulator``)."""
    return float(token_weights([u.c_tokens], [u.c_steps])[0])


def fold_carried(rnd: Round, carried: Mapping[int, FragmentUpload], oldest_base: int
                 ) -> tuple[list[FragmentUpload], dict[int, FragmentUpload], int]:
    """Late Δs of this fragment at ``rnd``'s close: (the Δs to fold in now, each learner's held Δ
    combined with its late one, as one; the late Δs to keep carrying: their learner's Δ in ``rnd``
    is in its sums already; how many were dropped as based before ``oldest_base``)."""
    fold, keep, stale = [], {}, 0
    for m, msg in carried.items():
        if msg.base_version < oldest_base:
            stale += 1
        elif m in rnd.contributions and m not in rnd.held:
            keep[m] = msg
        else:
            fold.append(msg if m not in rnd.held else combine(msg, rnd.contributions[m]))
            rnd.contributions[m] = fold[-1]
    taken = {m.learner for m in fold}
    fold += [rnd.contributions[m] for m in sorted(rnd.held) if m not in taken]
    return fold, keep, stale


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
            rnd.held.add(u.learner)  # merged at once, at the close
        rounds.append(((p, max(u.due_step for u in ups)), rnd))
    return rounds


def combine(a: FragmentUpload, b: FragmentUpload) -> FragmentUpload:
    """One learner's two Δs for a fragment (a late one and a newer one) as one: its whole displacement."""
    return replace(
        b, delta={n: a.delta[n] + b.delta[n] for n in b.delta}, c_steps=a.c_steps + b.c_steps,
        c_tokens=a.c_tokens + b.c_tokens, base_version=min(a.base_version, b.base_version), nbytes=a.nbytes + b.nbytes,
        payload=None,
    )


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

    def _contribute(self, rnd: Round, msg: FragmentUpload, delta_sq: Mapping[str, float]) -> None:
        """``msg`` joins ``rnd``: folded into its sums now (``delta_sq``: ‖Δ_t‖² by name, from the checks),
        or held whole while a late Δ of the same learner waits in the carry."""
        if msg.learner in self.carried[msg.fragment]:
            rnd.contributions[msg.learner] = msg
            rnd.held.add(msg.learner)
            return
        # The checks' ‖Δ_t‖² serve RDA where they are summed as the merge sums them (its own, or a Δ kept in
        # its codes: ``merge_sums``); a decoder's sums of another order would change the merge's bits.
        own = getattr(msg.delta, "sum_squares", None) is None or getattr(msg.delta, "merge_sums", False)
        self._fold(self._sums(rnd, msg.fragment), msg, delta_sq if own else None)
        rnd.contributions[msg.learner] = replace(msg, delta={}, payload=None)  # its counters; Δ is in the sums
        if getattr(msg.delta, "handed_over", False):
            msg.delta.clear()  # no one else holds it (a ``Decoded`` or ``Coded``): its memory is free for the close

    def _sums(self, rnd: Round, p: int) -> Accumulator:
        if rnd.sums is None:
            names = self.fragments[p]
            rnd.sums = Accumulator([self.theta[p][n].shape for n in names],
                                   [self.cfg.merge == "rda" and not self.is_embedding(n) for n in names], self.workers)
        return rnd.sums

    def _fold(self, sums: Accumulator, msg: FragmentUpload, delta_sq: Mapping[str, float] | None) -> None:
        p, names = msg.fragment, self.fragments[msg.fragment]
        # Staleness against p's version when the Δ folds in (its arrival, or the close for a carried Δ).
        gains = self.outer.gains(p, [self.version[p] - msg.base_version], [msg.delta])
        with self.timing("merge"):
            coded = getattr(msg.delta, "fold_into", None) is not None and list(msg.delta) == list(names)
            sums.add(msg.delta if coded else [msg.delta[n] for n in names], upload_weight(msg),
                     None if delta_sq is None else [delta_sq[n] for n in names], 1.0 if gains is None else gains[0])

    def _close(self, now_s: float, key: tuple[int, int], final: bool = False) -> list:
        p, due = key
        rnd = self.rounds.pop(key)
        sums = self._sums(rnd, p)
        # Older open rounds of this fragment are now late: their Θ has moved on. Their held Δs are
        # carried; the rest, already in their sums, join this merge as they are (each its own Δ).
        for old in [k for k in self.rounds if k[0] == p and k[1] < due]:
            older = self.rounds.pop(old)
            self._late([older.contributions[m] for m in sorted(older.held)])
            folded = {m: u for m, u in older.contributions.items() if m not in older.held}
            if not folded:
                continue
            if not self.cfg.carry_late:
                self.stats.late_dropped += len(folded)
                continue
            with self.timing("merge"):
                sums.absorb(older.sums)
            self.stats.late_carried += len(folded)
            for m, u in folded.items():
                rnd.contributions.setdefault(m, u)
        carried = self.carried[p]
        fold, self.carried[p], stale = fold_carried(rnd, carried, self.version[p] - self.cfg.max_staleness)
        self.stats.late_carried += len(carried) - len(self.carried[p]) - stale
        self.stats.stale_dropped += stale
        for u in fold:
            self._fold(sums, u, None)
        learners = sorted(rnd.contributions)
        ups = [rnd.contributions[m] for m in learners]
        with self.timing("merge"):
            delta = dict(zip(self.fragments[p], sums.result()))
        try:
            enc, update, self.theta[p], self.theta_sq[p] = close_step(
                self.outer, self.codec, p, self.theta[p], delta, self.workers, self.timing, self.theta_sq[p])
        except ProtocolError as e:
            # Θ_p and its momentum stay as they were; the learners keep their Δs' steps in θ and send again.
            self.stats.refused_rounds += 1
            self.notices.append(f"merge of fragment {p} (due step {due}, learners {learners}) refused: {e}")
            return []
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
            global_step=self.global_step, clock=self.clock, update=update, nbytes=enc.nbytes,
            contributors=tuple(learners), held_s={m: now_s - t for m, t in rnd.received_s.items()},
            payload=enc.payload, final=final, run_id=self.run_id, epoch=self.epoch, resumed_from=self.resumed_from,
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
