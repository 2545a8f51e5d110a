"""The syncer's records (what it knows of each learner, its counters) and its snapshot form: the
tensors a resume needs, and a snapshot read back and checked against this run before any of it is taken.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from wan_diloco import tree
from wan_diloco.clock import VectorClock
from wan_diloco.core.protocol import Tensors


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner: when it was last heard, its step and measured timings."""
    last_seen_s: float
    step: int = 0
    alive: bool = True
    step_s: float | None = None
    sync_s: float | None = None
    tau: int | None = None
    heard: bool = False  # it sent something; False: only ever declared lost while waited for


@dataclass
class SyncerStats:
    fragment_syncs: list[int]
    # Bounded: means over the most recent rounds, so a long networked run does not grow without end.
    quorum_sizes: deque = field(default_factory=lambda: deque(maxlen=10_000))
    grace_s: deque = field(default_factory=lambda: deque(maxlen=10_000))
    late_dropped: int = 0
    late_carried: int = 0  # late Δs merged into the fragment's next round instead
    stale_dropped: int = 0
    duplicate_dropped: int = 0  # Δs whose base predates the learner's own last merged Δ: their steps counted already
    stale_epoch: int = 0  # uploads based on an earlier syncer incarnation (before a resume)
    quarantines: int = 0
    refused_rounds: int = 0  # merges whose outer step came out non-finite: Θ kept as it was
    bytes_in: int = 0
    bytes_out: int = 0  # one copy per broadcast; the driver multiplies by recipients
    # Recent rounds: (closed at s, fragment, due step, contributors), for status pages and tests.
    history: deque = field(default_factory=lambda: deque(maxlen=10_000))


def snapshot_tensors(owned: Sequence[int], theta: Sequence[Tensors], outer_states: Mapping[int, Any]
                     ) -> dict[str, np.ndarray]:
    """Θ and outer momentum of each owned fragment, named ``theta/<p>/<tensor>`` and ``outer/<p>/...``.
    Θ arrays are shared, not copied: the core replaces them, never writes into them."""
    tensors: dict[str, np.ndarray] = {}
    for p in owned:
        tensors.update({f"theta/{p}/{n}": a for n, a in theta[p].items()})
        tensors.update(tree.to_named(outer_states[p], f"outer/{p}"))
    return tensors


@dataclass(frozen=True)
class Restored:
    """A snapshot read back (``read_snapshot``): every field checked, ready to be taken as a whole."""
    theta: list[dict[str, np.ndarray]]
    outer: dict[int, Any]
    versions: list[int]
    last_closed_due: list[int]
    fragment_syncs: list[int]
    global_step: int
    clock: VectorClock
    merged_at: dict[tuple[int, int], int]
    run_id: str
    epoch: int
    snapshot: int


def read_snapshot(tensors: Tensors, info: Mapping[str, Any], fragments: Sequence[Sequence[str]],
                  owned: Sequence[int], theta: Sequence[Tensors], outer_states: Mapping[int, Any]) -> Restored:
    """The state of a snapshot (``SyncerCore.export``'s tensors and info) for a core with these
    ``fragments``, ``owned`` ones, Θ shapes (``theta``) and outer states; ValueError names what does
    not fit this run."""
    P = len(fragments)
    if info.get("fragments") != [list(f) for f in fragments]:
        raise ValueError("snapshot: its fragments differ from this run's (another model or num_fragments?)")
    if list(info.get("owned", range(P))) != list(owned):
        raise ValueError(f"snapshot: of a syncer shard owning fragments {info.get('owned')}, this one owns "
                         f"{list(owned)} (another syncer.shards?)")
    restored = []
    for p, names in enumerate(fragments):
        frag = {}
        for n in names if p in outer_states else ():
            a = tensors.get(f"theta/{p}/{n}")
            if a is None or a.shape != theta[p][n].shape or a.dtype != np.float32:
                raise ValueError(f"snapshot: tensor theta/{p}/{n} missing or of the wrong shape or dtype")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"snapshot: tensor theta/{p}/{n} is not finite")
            frag[n] = np.array(a)
        restored.append(frag)
    outer = {p: tree.from_named(tensors, f"outer/{p}", outer_states[p], "snapshot") for p in owned}
    ints = lambda key: [int(x) for x in info[key]]  # noqa: E731
    versions, last_due, syncs = ints("versions"), ints("last_closed_due"), ints("fragment_syncs")
    if not len(versions) == len(last_due) == len(syncs) == P:
        raise ValueError(f"snapshot: counters for {len(versions)} fragments, expected {P}")
    clock = VectorClock.from_dict(info["clock"])
    merged = {(int(m), int(p)): int(v) for m, p, v in info["merged_at"]}
    return Restored(
        theta=restored, outer=outer, versions=versions, last_closed_due=last_due, fragment_syncs=syncs,
        global_step=int(info["global_step"]), clock=clock, merged_at=merged, run_id=str(info["run_id"]),
        epoch=int(info["epoch"]), snapshot=int(info["snapshot"]),
    )
