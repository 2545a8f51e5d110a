"""Sans-IO serving of the syncer's named objects and of the end of the run.

``route`` decides what a bulk request (``core.protocol.ObjectRequest``, parsed
from its name) gets from this syncer shard: a fragment (``ServeFragment``; a
``final/P`` waits until the final sync is done), a learner's data position
(``ServePosition``) or its donated state (``ServeDonation``). It refuses, with
a ProtocolError naming why, a request this shard does not serve or a learner
asking for another learner's objects. The driver only streams bytes.

``FinalSync`` holds the end-of-run bookkeeping: learners that sent their final
uploads too late, which final fragments each learner has fetched, and when the
syncer may end (everyone who took part, arrived late or is still alive has
every final fragment this shard owns, and the final parameters are written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from wan_diloco.core.protocol import ObjectRequest, ProtocolError, learner_node
from wan_diloco.core.shards import ShardPlan
from wan_diloco.core.syncer import SyncerCore


@dataclass(frozen=True)
class ServeFragment:
    """Driver: stream the current global ``fragment`` (``final``: wait for the final sync first, at most
    ``syncer.final_timeout_s``; count it fetched once its last byte is out: ``FinalSync.on_fetched``)."""

    fragment: int
    final: bool


@dataclass(frozen=True)
class ServePosition:
    """Driver: stream ``data``, learner ``learner``'s latest data position ("" when none is known)."""

    learner: int
    data: bytes


@dataclass(frozen=True)
class ServeDonation:
    """Driver: stream the state donated for ``learner`` once it is there (``Donations.lookup``)."""

    learner: int


Served = ServeFragment | ServePosition | ServeDonation


def route(name: str, sender: str, *, plan: ShardPlan, shard: int, num_learners: int,
          position_of) -> Served:
    """What bulk request ``name`` from ``sender`` gets from syncer ``shard``; ProtocolError (field
    ``object``) if nothing. ``position_of``: learner -> its data position (``Positions.of``)."""
    kind = name.partition("/")[0]
    if kind in ("donation", "position") and shard:
        raise ProtocolError(f"{name[:80]}: peer recovery is served by syncer shard 0, this is shard {shard}", "object")
    req = ObjectRequest.parse(name, len(plan.plan), num_learners)
    owner = plan.serves(req)
    if owner != shard:
        raise ProtocolError(f"{req.name}: fragment {req.index} is served by syncer shard {owner}, this is shard "
                            f"{shard}", "object")
    if req.kind in ObjectRequest.FRAGMENT_KINDS:
        return ServeFragment(req.index, final=req.kind == "final")
    if sender != learner_node(req.index):
        raise ProtocolError(f"{req.name} is for learner-{req.index}, not {sender[:40]!r}", "object")
    if req.kind == "position":
        return ServePosition(req.index, position_of(req.index).encode())
    return ServeDonation(req.index)


@dataclass
class FinalSync:
    """The end of the run at one syncer (shard), after its core merged the final uploads."""

    core: SyncerCore
    done: bool = False  # the core merged the final uploads (``final/P`` is served)
    saved: bool = False  # the final parameters are written (or given up on)
    late: set[int] = field(default_factory=set)  # learners whose final uploads came after the merge
    fetched: dict[int, set[int]] = field(default_factory=dict)  # learner -> final fragments streamed to it

    def on_upload(self, learner: int, final: bool) -> bool:
        """An upload arrived; True when it is a final one after the merge (acknowledged as late: the learner
        takes the final fragments like everyone else, and the syncer waits for its fetch)."""
        if final and self.core.final_done:
            self.late.add(learner)
            return True
        return False

    def on_merged(self) -> bool:
        """After the core acted: True once, when its final sync just completed (serve and write it now)."""
        if self.core.final_done and not self.done:
            self.done = True
            return True
        return False

    def on_saved(self) -> bool:
        self.saved = True
        return self.finished()

    def on_fetched(self, learner: int, fragment: int) -> bool:
        """``learner`` has fetched final ``fragment`` (its last byte is out); True when the syncer may end."""
        self.fetched.setdefault(learner, set()).add(fragment)
        return self.finished()

    def finished(self) -> bool:
        """Everyone who took part, arrived late, or is still alive has fetched every final fragment."""
        if not self.done or not self.saved:
            return False
        waiting = self.core.final_participants() | self.late | set(self.core.alive())
        return all(len(self.fetched.get(m, ())) == len(self.core.owned) for m in waiting)
