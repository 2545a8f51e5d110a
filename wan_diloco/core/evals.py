"""Sans-IO: when the run's eval curve takes a point (docs/operations.md, "Watching a run").

One rule for every driver: a point at each multiple k · ``every`` (k >= 1) of the global step, besides the
start and the end, which the drivers take themselves. A step may jump over a multiple (a learner adopts a
merged update's global step; the simulator's global step is the furthest learner's), so a point is due
when a multiple lies in (last, step], and it stands for the latest such multiple: checking ``step`` alone
for a multiple missed every point a jump stepped over (0, 100, 150, 200, 300 of a run set to every 50).
"""
from __future__ import annotations


def due_point(last: int, step: int, every: int) -> int | None:
    """The latest multiple of ``every`` in (``last``, ``step``], or None (none there, or ``every`` is 0: off)."""
    if not every or step <= last or step // every <= last // every:
        return None
    return step // every * every


def eval_point(last: int, step: int, every: int, learners: int, learner: int) -> int | None:
    """The point learner ``learner`` of ``learners`` owes having gone from step ``last`` to ``step``: the
    latest multiple k · ``every`` in (last, step] whose turn is its own (k mod learners = learner), else None.
    The learners of a networked run take turns, so one eval costs one learner's time."""
    if due_point(last, step, every) is None:
        return None
    top = step // every
    for k in range(top, max(last // every, top - learners), -1):  # turns repeat every `learners` points
        if k > 0 and k % learners == learner:
            return k * every
    return None
