"""How many syncer shards a run needs (docs/planning.md, "Syncer shards").

Every H steps each of M learners sends every fragment once, so the syncer
shards together merge M·N parameters per H·T_step seconds: 4·M·N / (H·T_step)
bytes/s of fp32-equivalent outer gradients (decoded, merged, stepped and
re-encoded). One shard merges C bytes/s (``bench/syncer.py`` measures C on the
syncer's host), so the run needs ceil(demand / C) shards; with fewer, rounds
queue at the syncer and the learners wait for their updates.
"""
from __future__ import annotations

import math

from wan_diloco.config import require


def merge_demand_gb_s(params: float, learners: int, sync_every: int, step_time_s: float) -> float:
    """GB/s of fp32-equivalent outer gradients all syncer shards must merge together."""
    require(params > 0 and learners >= 1 and sync_every >= 1 and step_time_s > 0, "shards",
            f"needs params, learners, sync_every and step time > 0, got {params}, {learners}, {sync_every}, "
            f"{step_time_s}")
    return 4.0 * learners * params / (sync_every * step_time_s) / 1e9


def shards_needed(params: float, learners: int, sync_every: int, step_time_s: float, shard_merge_gb_s: float) -> int:
    """The fewest shards whose merge rate covers the demand (at least 1)."""
    require(shard_merge_gb_s > 0, "plan.shard_merge_gb_s", f"must be > 0, got {shard_merge_gb_s}")
    return max(1, math.ceil(merge_demand_gb_s(params, learners, sync_every, step_time_s) / shard_merge_gb_s))


def shard_warning(params: float, learners: int, sync_every: int, step_time_s: float, shard_merge_gb_s: float,
                  shards: int) -> str | None:
    """One line if ``shards`` are too few for the run, else None."""
    need = shards_needed(params, learners, sync_every, step_time_s, shard_merge_gb_s)
    if need <= shards:
        return None
    demand = merge_demand_gb_s(params, learners, sync_every, step_time_s)
    return (f"the syncer must merge {demand:.3g} GB/s of fp32-equivalent outer gradients ({learners} learners x "
            f"{params / 1e6:.4g}M params every {sync_every} steps of {step_time_s:.3g} s); one shard merges "
            f"{shard_merge_gb_s:.3g} GB/s (plan.shard_merge_gb_s), so the run needs syncer.shards >= {need}, "
            f"it has {shards}")
