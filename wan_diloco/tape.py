"""Failure tapes: which learner or syncer is down when, as a JSON file shared by the planners, the
chaos harness and the simulated driver.

Format: a JSON list of objects, times in seconds since the start of the run
(virtual seconds in the simulated driver). Each entry is one fault, named as
the chaos harness names it (``runtime.chaos``), down in ``[down_at, up_at)``:

- ``{"learner": M, "down_at": T0, "up_at": T1}`` (``"kind": "kill_learner"`` may be
  written, and is the default): learner M is killed at T0 and restarted at T1; it
  takes up the global parameters and a healthy peer's state (``core.recovery``).
  An outage from ``down_at`` 0 is a learner that **joins late**, at T1.
- ``{"kind": "kill_syncer", "down_at": T0, "up_at": T1}``: the syncer is killed at T0
  and restarted at T1 from its newest complete snapshot, as its next incarnation;
  the learners that never stopped rejoin it.
- ``{"kind": "kill_syncer", "shard": S, "down_at": T0, "up_at": T1}``: syncer shard S
  alone (a run with ``syncer.shards`` > S), resumed from its own snapshot while the
  other shards go on merging.

Overlapping or touching outages of one target (a learner, the syncer, a shard)
are **merged** on load (the union is what it experiences), so tapes written by
different tools can be concatenated. Everything else that is wrong is rejected
with an error naming the entry and the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Union

from wan_diloco.config import ConfigError

KILL_LEARNER, KILL_SYNCER = "kill_learner", "kill_syncer"  # the chaos harness's names of these faults
KINDS = (KILL_LEARNER, KILL_SYNCER)
KEYS = ("learner", "down_at", "up_at")  # a learner outage's keys ("kind" optional)
SYNCER_KEYS = ("kind", "shard", "down_at", "up_at")  # a syncer outage's ("shard" optional)


@dataclasses.dataclass(frozen=True)
class Outage:
    """Learner ``learner`` is down from ``down_at`` (s) until ``up_at`` (s); from 0: it joins late."""

    learner: int
    down_at: float
    up_at: float

    kind = KILL_LEARNER

    @property
    def duration_s(self) -> float:
        return self.up_at - self.down_at

    @property
    def joins_late(self) -> bool:
        return self.down_at == 0.0

    def to_dict(self) -> dict:
        # No "kind": a learner outage is written as it always was, so older readers take it.
        return {"learner": self.learner, "down_at": self.down_at, "up_at": self.up_at}


@dataclasses.dataclass(frozen=True)
class SyncerOutage:
    """The syncer (``shard`` None) or syncer shard ``shard`` is down from ``down_at`` (s) until ``up_at`` (s),
    then resumes from its newest complete snapshot."""

    down_at: float
    up_at: float
    shard: int | None = None

    kind = KILL_SYNCER

    @property
    def duration_s(self) -> float:
        return self.up_at - self.down_at

    def to_dict(self) -> dict:
        return {"kind": KILL_SYNCER, **({} if self.shard is None else {"shard": self.shard}),
                "down_at": self.down_at, "up_at": self.up_at}


Fault = Union[Outage, SyncerOutage]


def learner_outages(tape: Iterable[Fault]) -> list[Outage]:
    """The learner outages of a tape (what a model of learners alone, e.g. data parallel, replays)."""
    return [f for f in tape if isinstance(f, Outage)]


def syncer_outages(tape: Iterable[Fault]) -> list[SyncerOutage]:
    return [f for f in tape if isinstance(f, SyncerOutage)]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number of seconds, got {value!r}")
    return float(value)


def _index(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: must be an integer >= 0, got {value!r}")
    return value


def _times(entry: dict, where: str) -> tuple[float, float]:
    down_at = _number(entry["down_at"], f"{where}.down_at")
    up_at = _number(entry["up_at"], f"{where}.up_at")
    if down_at < 0:
        raise ConfigError(f"{where}.down_at: must be >= 0, got {down_at}")
    if up_at <= down_at:
        raise ConfigError(f"{where}.up_at: must be later than down_at ({down_at}), got {up_at}")
    return down_at, up_at


def parse_entry(entry: Any, where: str) -> Fault:
    """One tape entry, validated; ``where`` names it in errors."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object with keys {', '.join(KEYS)}, got {type(entry).__name__}")
    kind = entry.get("kind", KILL_LEARNER)
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: unknown kind {kind!r}; kinds are {', '.join(KINDS)}")
    keys, optional = (KEYS, ("kind",)) if kind == KILL_LEARNER else (SYNCER_KEYS, ("shard",))
    missing = [k for k in keys if k not in entry and k not in optional]
    unknown = sorted(set(entry) - set(keys) - set(optional))
    if missing or unknown:
        raise ConfigError(f"{where}: " + (f"missing key {missing[0]!r}" if missing else f"unknown key {unknown[0]!r}")
                          + f"; a {kind} entry has {', '.join(k for k in keys if k not in optional)}"
                          + f" ({', '.join(optional)} optional)")
    down_at, up_at = _times(entry, where)
    if kind == KILL_LEARNER:
        return Outage(learner=_index(entry["learner"], f"{where}.learner"), down_at=down_at, up_at=up_at)
    shard = entry.get("shard")
    return SyncerOutage(down_at=down_at, up_at=up_at, shard=None if shard is None else _index(shard, f"{where}.shard"))


def _target(f: Fault) -> tuple:
    return (0, f.learner) if isinstance(f, Outage) else (1, -1 if f.shard is None else f.shard)


def merge_outages(outages: Iterable[Fault]) -> list[Fault]:
    """Union of each target's outages, sorted by (down_at, target): learners by id, then the syncer,
    then its shards."""
    by_target: dict[tuple, list[Fault]] = {}
    for o in sorted(outages, key=lambda o: (_target(o), o.down_at)):
        runs = by_target.setdefault(_target(o), [])
        if runs and o.down_at <= runs[-1].up_at:
            if o.up_at > runs[-1].up_at:
                runs[-1] = dataclasses.replace(runs[-1], up_at=o.up_at)
        else:
            runs.append(o)
    return sorted((o for runs in by_target.values() for o in runs), key=lambda o: (o.down_at, _target(o)))


def parse_tape(data: Any, source: str = "tape") -> list[Fault]:
    """Validate decoded JSON ``data`` and return its merged outages."""
    if not isinstance(data, list):
        raise ConfigError(f"{source}: must be a JSON list of outages, got {type(data).__name__}")
    return merge_outages(parse_entry(e, f"{source}: entry {i}") for i, e in enumerate(data))


def load_tape(path: str | Path) -> list[Fault]:
    """Read a tape file; a missing, malformed or invalid file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"tape {p}: not found")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"tape {p}: invalid JSON: {e}") from None
    return parse_tape(data, f"tape {p}")


def save_tape(path: str | Path, outages: Iterable[Fault]) -> None:
    """Write outages (merged, sorted) as a tape file."""
    entries = [o.to_dict() for o in merge_outages(outages)]
    for i, e in enumerate(entries):
        parse_entry(e, f"outage {i}")  # refuse to write what load_tape would reject
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # One outage per line: tapes run to 1e5 entries and stay diffable.
    p.write_text("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")


def scale_tape(outages: Iterable[Fault], factor: float) -> list[Fault]:
    """Multiply every time by ``factor`` (e.g. map two weeks of failures onto a one-hour simulated run)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ConfigError(f"time_scale: must be a finite number > 0, got {factor!r}")
    return [dataclasses.replace(o, down_at=o.down_at * factor, up_at=o.up_at * factor) for o in outages]
