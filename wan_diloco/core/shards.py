"""Syncer shards, sans-IO: which shard serves what, and S shards seen by a learner as one syncer
(docs/architecture.md, "Syncer shards").

``ShardPlan`` answers the lookups every driver needs (the runtime's syncer and
network thread, the simulator): the shard that owns fragment p, the shard that
serves a named object (``core.protocol.ObjectRequest``; peer recovery and data
positions are shard 0's), the fragments of a shard.

``ShardView`` is the learner's side:

Each shard has its own incarnation number (epoch): it resumes from its own
snapshots, alone. The learner's core follows one incarnation, so its network
side translates: the learner sees the combined epoch E = 1 + Σ_s (e_s − 1),
which grows by one whenever any shard resumes (the learner then rejoins; only the
fragments of the shards that resumed need fetching: ``refetch``), and
each message it sends carries, for the shard it goes to, that shard's epoch as
of the E it was stamped with. Messages of an earlier incarnation of a shard map
to an earlier E and are dropped as stale, as from a single syncer.

Snapshots are shard 0's: learners write their parts into its snapshots only,
so only shard 0 announces its cuts (``SnapshotCut``; ``cut`` refuses one from
another shard), and the learner is told a
snapshot to resume its own part from only when shard 0 resumed: the
``resumed_from`` it sees is shard 0's snapshot when shard 0's incarnation is
the one that changed last, and ``OTHER_SHARD_RESUMED`` when another shard
resumed since. Then shard 0 lost nothing: the learners' own state is as good as
before, so they rejoin (take up Θ again) and keep it; a learner that starts
then recovers from a peer rather than from an older part (``core.restore``).
Another shard's numbering never reaches the learner (it would take it for
shard 0's and skip writing its parts of snapshots up to it). Pure and sans-IO:
the ``NetThread`` calls it on its loop thread.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from wan_diloco import shards as shards_lib
from wan_diloco.core.protocol import ObjectRequest, ProtocolError, SnapshotCut


# ``resumed_from`` shown to a learner after a shard other than 0 resumed last: a new incarnation (not 0, which
# says "fresh start") that holds no part of the learner's (below every snapshot id, so it skips none).
OTHER_SHARD_RESUMED = -1


class ShardPlan:
    """Fragment -> owning shard (``wan_diloco.shards.owners``' plan), and who serves which request."""

    def __init__(self, plan: Sequence[int]):
        self.plan = list(plan)
        if not self.plan or min(self.plan) < 0:
            raise ValueError(f"a shard plan names a shard >= 0 for each fragment, got {self.plan!r}")
        self.shards = max(self.plan) + 1

    @classmethod
    def balanced(cls, nbytes: Sequence[int], shards: int) -> "ShardPlan":
        """The plan every learner and shard computes alike from the fragments' bytes."""
        return cls(shards_lib.owners(nbytes, shards))

    def shard_of(self, fragment: int) -> int:
        """The shard that merges and serves ``fragment``; ProtocolError if there is no such fragment."""
        if not (isinstance(fragment, int) and 0 <= fragment < len(self.plan)):
            raise ProtocolError(f"fragment {fragment} out of range 0..{len(self.plan) - 1}", "fragment")
        return self.plan[fragment]

    def owned(self, shard: int) -> list[int]:
        return shards_lib.owned(self.plan, shard)

    def serves(self, request: ObjectRequest) -> int:
        """The shard a named object is fetched from: a fragment's owner; shard 0 for peer recovery
        (``donation/M``) and data positions (``position/M``), which it alone keeps."""
        if request.kind in ObjectRequest.FRAGMENT_KINDS:
            return self.shard_of(request.index)
        return 0


class ShardView:
    """What the learner is told about S shards, and what each shard is told about the learner."""

    def __init__(self, plan: Sequence[int]):
        self.routes = ShardPlan(plan)  # the one routing rule, as the syncer's
        self.plan = self.routes.plan
        self.S = self.routes.shards
        self.epochs = [0] * self.S  # 0: not heard from yet (taken as its first incarnation)
        self.resumed = [0] * self.S  # the snapshot each shard's current incarnation resumed from
        self.last_changed = 0  # the shard whose incarnation changed last (a first hearing is no change)
        self.history: dict[int, tuple[int, ...]] = {}  # E -> the shards' epochs it stood for
        self.processes = [""] * self.S  # each shard's process id, from its Identity ("" : not heard from)

    def shard_of(self, fragment: int) -> int:
        return self.routes.shard_of(fragment)

    @property
    def epoch(self) -> int:
        """E: grows by one each time a shard resumes."""
        return 1 + sum(max(e, 1) - 1 for e in self.epochs)

    @property
    def resumed_from(self) -> int:
        """The snapshot the learner's own part is resumed from (see the module docstring): shard 0's when its
        incarnation changed last (0 if it never resumed and no other shard did), else OTHER_SHARD_RESUMED."""
        if self.last_changed:
            return OTHER_SHARD_RESUMED
        return self.resumed[0] or (OTHER_SHARD_RESUMED if any(self.resumed) else 0)

    def seen(self, shard: int, epoch: int, resumed_from: int) -> tuple[int, int]:
        """A message of ``shard``'s incarnation ``epoch`` arrived: (E, resumed_from) to show the learner.
        A newer incarnation moves E on; an older one maps to an E as many incarnations back (stale)."""
        if not epoch:  # a message that names no incarnation
            return 0, 0
        if epoch > self.epochs[shard]:
            if self.epochs[shard]:
                self.last_changed = shard
            self.epochs[shard], self.resumed[shard] = epoch, resumed_from
        E = self.epoch
        self.history.setdefault(E, tuple(self.epochs))
        if epoch < self.epochs[shard]:
            return max(1, E - (self.epochs[shard] - epoch)), self.resumed_from
        return E, self.resumed_from

    def refetch(self, epoch: int) -> list[int]:
        """The fragments a learner that followed E = ``epoch`` fetches to join the current E: those of the shards
        whose incarnation changed since (its copies of the others' are still theirs); every fragment when this
        view does not know what E = ``epoch`` stood for (0: it never joined)."""
        known = self.history.get(epoch)
        if known is None:
            return list(range(len(self.plan)))
        changed = {s for s in range(self.S) if max(known[s], 1) != max(self.epochs[s], 1)}
        return [p for p, s in enumerate(self.plan) if s in changed]

    def process_ids(self, shard: int, process: str) -> str:
        """Shard ``shard``'s Identity named its process: every shard's, comma-separated (``LearnerCore.meet``)."""
        if process:
            self.processes[shard] = process
        return ",".join(self.processes)

    def outgoing(self, shard: int, epoch: int) -> int:
        """The epoch of ``shard`` a message stamped with E = ``epoch`` carries there (0 stays 0)."""
        if not epoch:
            return 0
        known = self.history.get(epoch)
        if known is None:  # stamped before this view heard of it: the newest known for that shard
            return max(self.epochs[shard], 1)
        return max(known[shard], 1)

    def update(self, shard: int, u):
        """A GlobalUpdate (or a BulkFragment) from ``shard``, in the learner's terms."""
        if self.plan[u.fragment] != shard:
            raise ProtocolError(f"fragment {u.fragment} came from syncer shard {shard}; its owner is shard "
                                f"{self.plan[u.fragment]}")
        E, resumed = self.seen(shard, u.epoch, u.resumed_from)
        if isinstance(u, tuple):  # a BulkFragment
            return u._replace(epoch=E, resumed_from=resumed)
        return dataclasses.replace(u, epoch=E, resumed_from=resumed)

    def cut(self, shard: int, msg: SnapshotCut) -> SnapshotCut:
        """A snapshot announcement from ``shard``, in the learner's terms (its epoch an E); ProtocolError
        from a shard other than 0 (the learners' parts are in shard 0's snapshots only)."""
        if shard != 0:
            raise ProtocolError(f"a snapshot announcement came from syncer shard {shard}; learners write "
                                f"their parts into shard 0's snapshots only", "cut")
        if not 0 < msg.epoch <= max(self.epochs[0], 1):
            raise ProtocolError(f"a snapshot announcement of shard 0's incarnation {msg.epoch}, which its "
                                f"update stream has not named", "cut.epoch")
        # An earlier incarnation's maps to an E as many incarnations back (stale), as in ``seen``.
        return dataclasses.replace(msg, epoch=max(1, self.epoch - (max(self.epochs[0], 1) - msg.epoch)))
