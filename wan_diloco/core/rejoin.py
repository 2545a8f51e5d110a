"""Sans-IO: a learner and the syncer incarnation it follows (docs/operations.md, "Resume").

A syncer that comes back from a snapshot is a new incarnation: its identity at the start of an
update stream (``on_identity``), or on a fragment fetched after a version gap (``on_fetched``), says
so, and the learner rejoins it (``Rejoin``: fetch the global fragments, ``LearnerCore.join``; with S
syncer shards only those of the shards that resumed need fetching: ``ShardView.refetch`` and
``rejoin_fragments``, as the simulator's and the network learner's joins do). A
syncer of another run, or one restarted without a snapshot, ends the learner (``IncarnationError``,
from ``LearnerCore.meet``/``identity``). After a (re)join or a resync the learner takes up the
global step (``take_up_step``).
"""
from __future__ import annotations

from dataclasses import dataclass

from wan_diloco.core.learner import LearnerCore
from wan_diloco.core.protocol import Rejoin, Tensors
from wan_diloco.core.reports import Report

JOIN_TRIES = 3  # joins before a learner gives up on a syncer that changes incarnation during each


@dataclass(frozen=True)
class Resynced:
    """Driver: count it (a fragment installed after a version gap; the final report's ``resyncs``)."""

    fragment: int
    version: int


@dataclass(frozen=True)
class TakeUpStep:
    """Driver: take up the core's step as its train step and learning-rate schedule position where those
    are behind (``take_up_step``)."""


def on_identity(core: LearnerCore, now_s: float, run_id: str, epoch: int, resumed_from: int,
                processes: str = "") -> list[Rejoin]:
    """A (re)connected update stream said who the syncer is: is it still the one this learner follows?"""
    if core.meet(run_id, epoch, resumed_from, processes) == "new":
        return [Rejoin(epoch, resumed_from)]
    return []


def on_fetched(core: LearnerCore, now_s: float, run_id: str, epoch: int, resumed_from: int, fragment: int,
               values: Tensors, version: int, global_step: int) -> list:
    """A global fragment fetched after a version gap (``Resync``): install it if it is newer than what this
    learner holds; rejoin if a new incarnation served it (the syncer came back while we fetched)."""
    which = core.identity(run_id, epoch, resumed_from)
    if which == "new":
        return [Rejoin(epoch, resumed_from)]
    out: list = []
    if which == "same" and version > core.version[fragment]:
        out = [*core.resync(fragment, values, version, global_step), Resynced(fragment, version)]
    return [*out, TakeUpStep()]


def rejoin_fragments(fetched: dict[int, tuple[Tensors, int]], base: list[Tensors],
                     version: list[int]) -> list[tuple[Tensors, int]]:
    """What ``LearnerCore.join`` takes after a rejoin that fetched only ``fetched`` (fragment -> (values,
    version); with S syncer shards, those of the shards that resumed: ``ShardView.refetch``): the learner's
    own copies of the others, whose shards it still follows."""
    return [fetched[p] if p in fetched else (base[p], version[p]) for p in range(len(base))]


def same_incarnation(served: list[tuple[str, int]]) -> bool:
    """The (run id, incarnation) of every fragment a join fetched agree (else the syncer restarted while
    the learner fetched: join again)."""
    return len(set(served)) == 1


def rejoin_report(learner: int, step: int, epoch: int, resumed_from: int) -> Report:
    why = (f"the syncer resumed from snapshot {resumed_from} as incarnation {epoch}" if resumed_from > 0 else
           f"a syncer shard other than 0 resumed (incarnation {epoch}): the learner's own state stays")
    return Report({"event": "rejoin", "role": "learner", "learner": learner, "step": step, "why": why})


def take_up_step(global_step: int, train_step: int, schedule_step: int) -> tuple[int | None, int | None]:
    """A (re)joining or resynced learner takes up the global step: (its new train step, its new
    learning-rate schedule position), None where it is not behind. A fresh inner optimizer (no peer
    state, or peer recovery off) would otherwise warm up again and train at the peak rate while the
    others have decayed; a donor's optimizer ahead of the global step stays where it is."""
    return (global_step if global_step > train_step else None,
            global_step if global_step > schedule_step else None)
