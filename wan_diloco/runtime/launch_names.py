"""The names of a launched run's children, one spelling each: ``syncer`` and ``syncer-S`` for the syncer's
shards, ``learner-N`` for a learner and ``learner-N.pI`` for process I > 0 of a learner of several processes.
The supervisor, the run summary and the chaos driver all tell children apart by these names."""
from __future__ import annotations

import re

# learner-N, and learner-N.pI for process I > 0 of a learner of several processes (learner.hosts).
_LEARNER_NAME = re.compile(r"learner-(0|[1-9][0-9]{0,8})(?:\.p([1-9][0-9]{0,4}))?")


def is_learner_name(name: str) -> bool:
    """Whether ``name`` is a learner's process (``learner-N`` or ``learner-N.pI``), not a syncer or a helper."""
    return _LEARNER_NAME.fullmatch(name) is not None


def learner_of(name: str) -> int:
    """``learner-N`` or ``learner-N.pI`` -> N (one spelling: ASCII digits, no leading zero); ValueError
    naming it otherwise."""
    return learner_process(name)[0]


def learner_process(name: str) -> tuple[int, int]:
    """``learner-N`` -> (N, 0), ``learner-N.pI`` -> (N, I): the learner and which of its processes (0, the
    leader, keeps the plain name: it is the learner as the run sees it)."""
    match = _LEARNER_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a learner's name (learner-N, or learner-N.pI for its process I)")
    return int(match.group(1)), int(match.group(2) or 0)


def shard_name(shard: int) -> str:
    """The child of syncer shard ``shard``: ``syncer`` (shard 0, the only one of an unsharded run), ``syncer-S``."""
    return "syncer" if shard == 0 else f"syncer-{shard}"


def is_syncer(name: str) -> bool:
    return name == "syncer" or name.startswith("syncer-")


def shard_of(name: str) -> int:
    return 0 if name == "syncer" else int(name.removeprefix("syncer-"))


def process_name(m: int, process: int) -> str:
    return f"learner-{m}" + (f".p{process}" if process else "")
