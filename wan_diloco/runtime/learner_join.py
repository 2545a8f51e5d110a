"""A networked learner takes up the syncer's global parameters: at its start, at a rejoin, after the syncer
(or one of its shards) resumed from a snapshot (``core.rejoin``).

With S syncer shards a rejoin fetches only the fragments of the shards whose incarnation changed since the
one it followed (``ShardView.refetch``, asked through ``NetThread.refetch``) and keeps its own copies of the
others (``rejoin.rejoin_fragments``), as the simulator does. ``join`` is a method of
``runtime.learner.Learner`` kept in a module of its own (``self`` is the learner).
"""
from __future__ import annotations

from typing import Callable

from wan_diloco.core import rejoin as rj
from wan_diloco.core.messages import BulkFragment, ObjectRequest
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.exits import SyncerLost


def fetch(net, epoch: int, wait: Callable, learner: int) -> dict[int, BulkFragment]:
    """The global fragments a learner that followed incarnation ``epoch`` (0: none yet) fetches to join, by
    fragment, all of one incarnation. Fetched again while they disagree on it, or while a shard resumed
    during the fetch (``refetch`` asked again names a fragment not fetched); SyncerLost after
    ``rejoin.JOIN_TRIES`` tries."""
    for _ in range(rj.JOIN_TRIES):
        # Never nothing: the fetched fragments say which incarnation the learner joins.
        wanted = net.refetch(epoch) or list(range(len(net.codec.layout.fragments)))
        futures = {p: net.fetch_fragment(ObjectRequest("fragment", p)) for p in wanted}
        got = {p: wait(fut) for p, fut in futures.items()}
        if rj.same_incarnation([(g.run_id, g.epoch) for g in got.values()]) and set(net.refetch(epoch)) <= set(got):
            return got
    raise SyncerLost(f"learner {learner}: the syncer changed incarnation during each of {rj.JOIN_TRIES} joins")


def join(self, timeout_s: float) -> BulkFragment:
    """Take up the syncer's global parameters and say which fragments it fetched (event ``join``); returns a
    fragment fetched (its identity fields say which syncer incarnation it is)."""
    if self.sync is not None:
        self.sync.flush()  # what was encoded for the old state is sent before its residuals go
    got = fetch(self.net, self.core.epoch, lambda fut: self.wait(fut, timeout_s), self.m)
    self.pending_resync.clear()  # fetches of the old incarnation mean nothing now
    first = got[min(got)]
    fragments = rj.rejoin_fragments({p: (g.values, g.version) for p, g in got.items()}, self.core.base,
                                    self.core.version)
    self.handle(self.core.join(first.run_id, first.epoch, first.resumed_from, fragments,
                               max(g.global_step for g in got.values())))
    self.take_up_step()
    emit({"event": "join", "role": "learner", "learner": self.m, "step": self.core.step, "epoch": first.epoch,
          "fetched": sorted(got)})
    return first
