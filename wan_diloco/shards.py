"""Which syncer shard owns which fragment (docs/architecture.md, "Syncer shards").

A shard is one syncer process: it takes in, merges, steps and sends out its
fragments only. Shards must carry equal bytes, since every learner sends every
fragment once per period and the busiest shard sets the pace. Fragments are
assigned largest first, each to the shard with the fewest bytes so far (ties to
the lower index): deterministic, so every learner and shard computes the same
plan from the layout alone, with nothing to exchange.
"""
from __future__ import annotations

from typing import Sequence


def owners(nbytes: Sequence[int], shards: int) -> list[int]:
    """Shard of each fragment, balanced by bytes; every shard gets at least one fragment."""
    P = len(nbytes)
    if not isinstance(shards, int) or not 1 <= shards <= P:
        raise ValueError(f"syncer.shards must be in 1..{P} (the number of fragments), got {shards!r}")
    load = [0] * shards
    out = [0] * P
    for p in sorted(range(P), key=lambda p: (-nbytes[p], p)):
        s = min(range(shards), key=lambda s: (load[s], s))
        out[p] = s
        load[s] += nbytes[p]
    return out


def owned(plan: Sequence[int], shard: int) -> list[int]:
    """The fragments of ``shard`` in ``plan`` (``owners``' result)."""
    return [p for p, s in enumerate(plan) if s == shard]


def imbalance(nbytes: Sequence[int], plan: Sequence[int]) -> float:
    """Bytes of the busiest shard over the mean shard's: 1.0 is perfect balance."""
    shards = max(plan) + 1
    load = [0] * shards
    for p, s in enumerate(plan):
        load[s] += nbytes[p]
    return max(load) / (sum(load) / shards) if sum(load) else 1.0
