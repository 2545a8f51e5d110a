"""A syncer round's pieces: what one holds, late Δs folded into the next, the merge and outer step
that close it, and the end-of-run sync's rounds. Functions of plain values; ``SyncerCore`` keeps the
books (versions, clock, stats) around them.
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from wan_diloco.core.protocol import Codec, FragmentUpload, ProtocolError, Tensors, encode_or_refuse
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
                 workers: Workers, timing: Timing) -> dict[str, np.ndarray]:
    """The Δs of one round merged, weighted by tokens (equally where no learner counted any)."""
    weights = token_weights([u.c_tokens for u in ups], [u.c_steps for u in ups])
    if weights.sum() <= 0:
        weights = np.ones(len(ups))
    with timing("merge"):
        return merge_fragment([u.delta for u in ups], weights, method, is_embedding, workers)


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
