"""How many syncer shards a run needs (docs/planning.md, "Syncer shards").

Every H steps each of M learners sends every fragment once, so the syncer
shards together merge M·N parameters per H·T_step seconds: 4·M·N / (H·T_step)
bytes/s of fp32-equivalent outer gradients (decoded, merged, stepped and
re-encoded). One shard merges C bytes/s (``bench/syncer.py`` measures C on the
syncer's host), so the run needs ceil(demand / C) shards; with fewer, rounds
queue at the syncer and the learners wait for their updates.

C is ``plan.shard_merge_gb_s`` when the run's file sets it; else the rate
``bench/syncer.py`` last measured in this checkout (``bench/results/syncer.json``,
``planner.merged_fp32_gb_s_one_shard_by_learners``: one shard, by learners M),
else ``DEFAULT_SHARD_MERGE_GB_S`` (an installed package has no ``bench/``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from wan_diloco.config import ConfigError, require

DEFAULT_SHARD_MERGE_GB_S = 1.0  # one shard at M = 4 on 2 shared cores, end to end after #26 (docs/benchmarks.md)
MEASURED_FILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "syncer.json"
MEASURED_FIELD = "merged_fp32_gb_s_one_shard_by_learners"


def shard_merge_rate(configured: float | None, learners: int, measured: Path = MEASURED_FILE) -> tuple[float, str]:
    """(GB/s one shard merges, where that figure came from): the configured rate, else the measured one at
    the measured M nearest ``learners`` (ties: the smaller M), else the default. A measured file that is
    there but unreadable is an error naming it, not silently the default."""
    if configured is not None:
        return configured, "plan.shard_merge_gb_s"
    try:
        text = measured.read_text()
    except FileNotFoundError:
        return DEFAULT_SHARD_MERGE_GB_S, f"the default (no {measured.name} measured here)"
    try:
        table = json.loads(text)["planner"][MEASURED_FIELD]
        rates = {int(m): float(r) for m, r in table.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{measured}: planner.{MEASURED_FIELD} is not an object of learners -> GB/s "
                          f"({type(e).__name__}: {e}); fix the file or set plan.shard_merge_gb_s") from None
    good = {m: r for m, r in rates.items() if m >= 1 and math.isfinite(r) and r > 0}
    if not good or len(good) != len(rates):
        raise ConfigError(f"{measured}: planner.{MEASURED_FIELD} needs learners >= 1 and rates > 0, got {table}; "
                          "fix the file or set plan.shard_merge_gb_s")
    m = min(good, key=lambda k: (abs(k - learners), k))
    return good[m], f"measured by bench/syncer.py at M = {m} ({measured.name})"


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
                  shards: int, rate_from: str = "plan.shard_merge_gb_s") -> str | None:
    """One line if ``shards`` are too few for the run, else None."""
    need = shards_needed(params, learners, sync_every, step_time_s, shard_merge_gb_s)
    if need <= shards:
        return None
    demand = merge_demand_gb_s(params, learners, sync_every, step_time_s)
    return (f"the syncer must merge {demand:.3g} GB/s of fp32-equivalent outer gradients ({learners} learners x "
            f"{params / 1e6:.4g}M params every {sync_every} steps of {step_time_s:.3g} s); one shard merges "
            f"{shard_merge_gb_s:.3g} GB/s ({rate_from}), so the run needs syncer.shards >= {need}, "
            f"it has {shards}")
