"""S syncer shards in the simulator: one ``SyncerCore`` per shard behind the single-syncer interface.

Each shard owns the fragments ``shards.owners`` gives it and runs its own
rounds, grace windows and outer state, as in a real run; metadata and liveness
reach every shard. A shard's merge takes the time its work needs at
``plan.shard_merge_gb_s`` (with ``simulate.merge_takes_time``; else no time), queued behind its earlier merges:
the broadcast leaves when the shard is done (``ShardedSyncer.ready_at``), so a
run with too few shards for its model and learners shows the wait.

A shard can be killed and resumed from its own snapshot (``down``/``resumed``)
while the others go on. Learners see one syncer through the core's
``ShardView``, as through the network driver's: the incarnation E = 1 + Σ_s (e_s − 1)
grows by one whenever a shard resumes, every message a learner sends carries, for
the shard it goes to, that shard's incarnation as of the E it was stamped with, only
shard 0 announces its snapshots (the learners' parts are in shard 0's snapshots), and
the snapshot a rejoin names is shard 0's only when shard 0 resumed last.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from wan_diloco.core import FINAL_TIMER, Broadcast, GlobalUpdate, SyncerCore
from wan_diloco.core.shards import ShardView
from wan_diloco.core.syncer import SyncerStats


class ShardedSyncer:
    """What ``Simulation`` uses of a ``SyncerCore``, over S of them."""

    def __init__(self, cores: list[SyncerCore], plan: list[int], fragment_bytes: list[int], merge_gb_s: float = 0.0):
        self.cores, self.plan, self.fragment_bytes, self.merge_gb_s = cores, plan, fragment_bytes, merge_gb_s
        self.busy_until = [0.0] * len(cores)  # when each shard finishes the merges queued on it
        self.queued_s = 0.0  # virtual seconds rounds waited for their shard to finish earlier merges
        self.up = [True] * len(cores)  # False while a shard is killed: what is sent to it is lost
        self.view = ShardView(plan)  # one view for every learner: they all hear the same shards

    # ---- events: routed to the owner, or to every shard --------------------------------------

    def on_metadata(self, now_s: float, msg) -> list:
        return [self._out(s, a) for s, c in self._live() for a in c.on_metadata(now_s, self._in(s, msg))]

    def on_fragment(self, now_s: float, msg) -> list:
        s = self.view.routes.shard_of(msg.fragment)
        return [self._out(s, a) for a in self.cores[s].on_fragment(now_s, self._in(s, msg))] if self.up[s] else []

    def on_timer(self, now_s: float, key) -> list:
        if key == FINAL_TIMER:
            return [self._out(s, a) for s, c in self._live() for a in c.on_timer(now_s, key)]
        s = self.view.routes.shard_of(key[0])
        return [self._out(s, a) for a in self.cores[s].on_timer(now_s, key)] if self.up[s] else []

    def on_peer_lost(self, now_s: float, learner: int) -> list:
        return [self._out(s, a) for s, c in self._live() for a in c.on_peer_lost(now_s, learner)]

    # ---- one syncer to the learners (core.shards.ShardView) --------------------------------

    def _live(self):
        return [(s, c) for s, c in enumerate(self.cores) if self.up[s]]

    @property
    def epoch(self) -> int:
        """E: the incarnation the learners see, one more for each shard resume."""
        return self.view.epoch

    @property
    def resumed_from(self) -> int:
        return self.view.resumed_from

    @property
    def run_id(self) -> str:
        return self.cores[0].run_id

    def epoch_at(self, shard: int, epoch: int) -> int:
        """Shard ``shard``'s incarnation as of the learners' E = ``epoch``."""
        return self.view.outgoing(shard, epoch)

    def _in(self, shard: int, msg):
        """A learner's message stamped with E, as shard ``shard`` knows it: its epoch as of that E."""
        epoch = self.view.outgoing(shard, msg.epoch)
        return msg if epoch == msg.epoch else dataclasses.replace(msg, epoch=epoch)

    def _out(self, shard: int, action):
        return Broadcast(self.view.update(shard, action.msg)) if isinstance(action, Broadcast) else action

    def down(self, shard: int) -> None:
        self.up[shard] = False

    def resumed(self, shard: int, core: SyncerCore) -> None:
        """Shard ``shard`` came back as ``core`` (restored from its snapshot, its epoch one more)."""
        self.cores[shard], self.up[shard] = core, True
        self.busy_until[shard] = 0.0
        self.view.seen(shard, core.epoch, core.resumed_from)  # as the Identity of its new update stream

    def ready_at(self, now_s: float, msg: GlobalUpdate) -> float:
        """When the shard that closed the round of the broadcast ``msg`` has finished its merge (queued on
        that shard)."""
        if not self.merge_gb_s:
            return now_s
        p = msg.fragment
        s = self.view.routes.shard_of(p)
        work_s = len(msg.contributors) * self.fragment_bytes[p] / (self.merge_gb_s * 1e9)
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
