"""Failure tapes: when each learner is down, as a JSON file shared by the planners and the simulated driver.

Format: a JSON list of objects ``{"learner": int, "down_at": float, "up_at": float}``,
times in seconds since the start of the run (virtual seconds in the simulated
driver). A learner is not training in ``[down_at, up_at)``.

Overlapping or touching outages of one learner are **merged** on load (the
union is what the learner experiences), so tapes written by different tools
can be concatenated. Everything else that is wrong is rejected with an error
naming the entry.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable

from wan_diloco.config import ConfigError

KEYS = ("learner", "down_at", "up_at")


@dataclasses.dataclass(frozen=True)
class Outage:
    """Learner ``learner`` is down from ``down_at`` (s) until ``up_at`` (s)."""

    learner: int
    down_at: float
    up_at: float

    @property
    def duration_s(self) -> float:
        return self.up_at - self.down_at


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number of seconds, got {value!r}")
    return float(value)


def parse_entry(entry: Any, where: str) -> Outage:
    """One tape entry, validated; ``where`` names it in errors."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object with keys {', '.join(KEYS)}, got {type(entry).__name__}")
    missing = [k for k in KEYS if k not in entry]
    unknown = sorted(set(entry) - set(KEYS))
    if missing or unknown:
        raise ConfigError(f"{where}: " + (f"missing key {missing[0]!r}" if missing else f"unknown key {unknown[0]!r}")
                          + f"; an entry has exactly {', '.join(KEYS)}")
    learner = entry["learner"]
    if isinstance(learner, bool) or not isinstance(learner, int) or learner < 0:
        raise ConfigError(f"{where}.learner: must be an integer >= 0, got {learner!r}")
    down_at = _number(entry["down_at"], f"{where}.down_at")
    up_at = _number(entry["up_at"], f"{where}.up_at")
    if down_at < 0:
        raise ConfigError(f"{where}.down_at: must be >= 0, got {down_at}")
    if up_at <= down_at:
        raise ConfigError(f"{where}.up_at: must be later than down_at ({down_at}), got {up_at}")
    return Outage(down_at=down_at, up_at=up_at, learner=learner)


def merge_outages(outages: Iterable[Outage]) -> list[Outage]:
    """Union of each learner's outages, sorted by (down_at, learner)."""
    by_learner: dict[int, list[Outage]] = {}
    for o in sorted(outages, key=lambda o: (o.learner, o.down_at)):
        runs = by_learner.setdefault(o.learner, [])
        if runs and o.down_at <= runs[-1].up_at:
            if o.up_at > runs[-1].up_at:
                runs[-1] = dataclasses.replace(runs[-1], up_at=o.up_at)
        else:
            runs.append(o)
    return sorted((o for runs in by_learner.values() for o in runs), key=lambda o: (o.down_at, o.learner))


def parse_tape(data: Any, source: str = "tape") -> list[Outage]:
    """Validate decoded JSON ``data`` and return its merged outages."""
    if not isinstance(data, list):
        raise ConfigError(f"{source}: must be a JSON list of outages, got {type(data).__name__}")
    return merge_outages(parse_entry(e, f"{source}: entry {i}") for i, e in enumerate(data))


def load_tape(path: str | Path) -> list[Outage]:
    """Read a tape file; a missing, malformed or invalid file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"tape {p}: not found")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"tape {p}: invalid JSON: {e}") from None
    return parse_tape(data, f"tape {p}")


def save_tape(path: str | Path, outages: Iterable[Outage]) -> None:
    """Write outages (merged, sorted) as a tape file."""
    entries = [{"learner": o.learner, "down_at": o.down_at, "up_at": o.up_at} for o in merge_outages(outages)]
    for i, e in enumerate(entries):
        parse_entry(e, f"outage {i}")  # refuse to write what load_tape would reject
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # One outage per line: tapes run to 1e5 entries and stay diffable.
    p.write_text("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")


def scale_tape(outages: Iterable[Outage], factor: float) -> list[Outage]:
    """Multiply every time by ``factor`` (e.g. map two weeks of failures onto a one-hour simulated run)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ConfigError(f"time_scale: must be a finite number > 0, got {factor!r}")
    return [Outage(down_at=o.down_at * factor, up_at=o.up_at * factor, learner=o.learner) for o in outages]
