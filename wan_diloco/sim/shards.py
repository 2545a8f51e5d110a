"""S syncer shards in the simulator: one ``SyncerCore`` per shard behind the single-syncer interface.

Each shard owns the fragments ``shards.owners`` gives it and runs its own
rounds, grace windows and outer state, as in a real run; metadata and liveness
reach every shard. A shard's merge takes the time its work needs at
``plan.shard_merge_gb_s`` (with ``simulate.merge_takes_time``; else no time), queued behind its earlier merges:
the broadcast leaves when the shard is done (``ShardedSyncer.ready_at``), so a
run with too few shards for its model and learners shows the wait.
"""
from __future__ import annotations

from collections import deque

from wan_diloco.core import FINAL_TIMER, Broadcast, SyncerCore
from wan_diloco.core.syncer import SyncerStats


class ShardedSyncer:
    """What ``Simulation`` uses of a ``SyncerCore``, over S of them."""

    def __init__(self, cores: list[SyncerCore], plan: list[int], fragment_bytes: list[int], merge_gb_s: float = 0.0):
        self.cores, self.plan, self.fragment_bytes, self.merge_gb_s = cores, plan, fragment_bytes, merge_gb_s
        self.busy_until = [0.0] * len(cores)  # when each shard finishes the merges queued on it
        self.queued_s = 0.0  # virtual seconds rounds waited for their shard to finish earlier merges

    # ---- events: routed to the owner, or to every shard --------------------------------------

    def on_metadata(self, now_s: float, msg) -> list:
        return [a for c in self.cores for a in c.on_metadata(now_s, msg)]

    def on_fragment(self, now_s: float, msg) -> list:
        return self.cores[self.plan[msg.fragment]].on_fragment(now_s, msg)

    def on_timer(self, now_s: float, key) -> list:
        if key == FINAL_TIMER:
            return [a for c in self.cores for a in c.on_timer(now_s, key)]
        return self.cores[self.plan[key[0]]].on_timer(now_s, key)

    def on_peer_lost(self, now_s: float, learner: int) -> list:
        return [a for c in self.cores for a in c.on_peer_lost(now_s, learner)]

    def ready_at(self, now_s: float, action) -> float:
        """When the shard that closed ``action``'s round has finished its merge (queued on that shard)."""
        if not isinstance(action, Broadcast) or not self.merge_gb_s:
            return now_s
        p = action.msg.fragment
        s = self.plan[p]
        work_s = len(action.msg.contributors) * self.fragment_bytes[p] / (self.merge_gb_s * 1e9)
        start_s = max(now_s, self.busy_until[s])
        self.queued_s += start_s - now_s
        self.busy_until[s] = start_s + work_s
        return self.busy_until[s]

    # ---- state: each fragment's from its owner --------------------------------------------

    @property
    def theta(self) -> list[dict]:
        return [self.cores[s].theta[p] for p, s in enumerate(self.plan)]

    @property
    def version(self) -> list[int]:
        return [self.cores[s].version[p] for p, s in enumerate(self.plan)]

    @property
    def final_done(self) -> bool:
        return all(c.final_done for c in self.cores)

    def global_params(self) -> dict:
        return {n: a for c in self.cores for n, a in c.global_params().items()}

    @property
    def stats(self) -> SyncerStats:
        """The shards' counters added up (fragment syncs from each fragment's owner)."""
        out = SyncerStats(fragment_syncs=[self.cores[s].stats.fragment_syncs[p] for p, s in enumerate(self.plan)])
        out.quorum_sizes, out.grace_s, out.history = deque(), deque(), deque()
        for c in self.cores:
            st = c.stats
            out.quorum_sizes.extend(st.quorum_sizes)
            out.grace_s.extend(st.grace_s)
            out.history.extend(st.history)
            for name in ("late_dropped", "late_carried", "stale_dropped", "duplicate_dropped", "stale_epoch",
                         "quarantines", "refused_rounds", "bytes_in", "bytes_out"):
                setattr(out, name, getattr(out, name) + getattr(st, name))
        return out
