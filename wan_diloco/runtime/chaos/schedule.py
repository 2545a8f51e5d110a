"""Fault schedules of the chaos harness: parsed from JSON or TOML, made round-robin, or from a
failure tape (see the package docstring for the kinds)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

from wan_diloco.config import ConfigError
from wan_diloco.tape import Outage, SyncerOutage, merge_outages
from wan_diloco.spec import RunSpec


KINDS = ("kill_learner", "stop_learner", "kill_syncer", "cut_link", "disk_full", "restart_syncer_fresh")
# Each kind's one optional duration key: how long the fault lasts before the harness undoes it.
HOLD_KEY = {"kill_learner": "down_s", "kill_syncer": "down_s", "stop_learner": "duration_s", "cut_link": "duration_s",
            "disk_full": "duration_s", "restart_syncer_fresh": "down_s"}
# Kinds whose one target is the syncer (its process, or its checkpoint.dir).
SYNCER_KINDS = ("kill_syncer", "disk_full", "restart_syncer_fresh")
DEFAULT_HOLD_S = 5.0
KEYS = ("t_s", "kind", "target", "down_s", "duration_s")

Note = Callable[[str], None]


# ---- schedules ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` hits ``target`` at ``t_s`` (seconds after every learner started training) and is
    undone (restart, SIGCONT, link restored) ``hold_s`` later."""

    t_s: float
    kind: str
    target: str
    hold_s: float = DEFAULT_HOLD_S

    def to_dict(self) -> dict:
        return {"t_s": self.t_s, "kind": self.kind, "target": self.target, HOLD_KEY[self.kind]: self.hold_s}


def learner_name(m: int) -> str:
    return f"learner-{m}"


def learner_index(target: str) -> int | None:
    """``learner-N`` -> N; anything else -> None."""
    prefix, _, index = target.partition("-")
    return int(index) if prefix == "learner" and index.isascii() and index.isdigit() else None


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _check_target(kind: str, target: Any, where: str, learners: int, regions: tuple[str, ...]) -> str:
    if kind in SYNCER_KINDS:
        if target not in (None, "syncer"):
            raise ConfigError(f"{where}.target: {kind} hits 'syncer', got {target!r}")
        return "syncer"
    if not isinstance(target, str):
        raise ConfigError(f"{where}.target: {kind} needs a target such as 'learner-0', got {target!r}")
    m = learner_index(target)
    if m is not None and m < learners:
        return target
    if kind == "cut_link" and target in regions:
        return target
    known = f"learner-0..learner-{learners - 1}" + (f" or a region ({', '.join(regions)})" if kind == "cut_link" else "")
    raise ConfigError(f"{where}.target: unknown target {target!r}; this run has {known}")


def parse_fault(entry: Any, where: str, learners: int, regions: Iterable[str] = ()) -> Fault:
    """One schedule entry, validated against a run of ``learners`` learners in ``regions``."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object with t_s, kind, target, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a fault has {', '.join(KEYS)}")
    kind = entry.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: unknown kind {kind!r}; kinds are {', '.join(KINDS)}")
    if "t_s" not in entry:
        raise ConfigError(f"{where}: missing key 't_s' (seconds after the learners start)")
    t_s = _seconds(entry["t_s"], f"{where}.t_s")
    hold_key = HOLD_KEY[kind]
    other = next((k for k in ("down_s", "duration_s") if k != hold_key and k in entry), None)
    if other:
        raise ConfigError(f"{where}.{other}: {kind} takes {hold_key!r}, not {other!r}")
    hold_s = _seconds(entry.get(hold_key, DEFAULT_HOLD_S), f"{where}.{hold_key}")
    target = _check_target(kind, entry.get("target"), where, learners, tuple(regions))
    return Fault(t_s, kind, target, hold_s)


def parse_schedule(data: Any, source: str, learners: int, regions: Iterable[str] = ()) -> list[Fault]:
    """Decoded schedule (a list of faults, or ``{"fault": [...]}`` as TOML gives), sorted by time."""
    if isinstance(data, dict):
        extra = sorted(set(data) - {"fault"})
        if extra:
            raise ConfigError(f"{source}: unknown table {extra[0]!r}; faults are [[fault]] entries")
        data = data.get("fault", [])
    if not isinstance(data, list):
        raise ConfigError(f"{source}: must be a list of faults, got {type(data).__name__}")
    regions = tuple(regions)
    faults = [parse_fault(e, f"{source}: fault {i}", learners, regions) for i, e in enumerate(data)]
    return sorted(faults, key=lambda f: f.t_s)


def load_schedule(path: str | Path, learners: int, regions: Iterable[str] = ()) -> list[Fault]:
    """A schedule file: ``.toml`` ([[fault]] entries) or JSON (a list); errors name the file and entry."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"schedule {p}: not found")
    text = p.read_text(errors="replace")
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"schedule {p}: invalid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
    return parse_schedule(data, f"schedule {p}", learners, regions)


def round_robin(learners: int, every_s: float, until_s: float, syncer_at_s: float | None = None,
                down_s: float = DEFAULT_HOLD_S, syncer_down_s: float = DEFAULT_HOLD_S,
                first_s: float | None = None) -> list[Fault]:
    """A learner killed every ``every_s`` (learner-0, learner-1, ... in turn) from ``first_s`` (default
    ``every_s``) until before ``until_s``, plus one syncer kill at ``syncer_at_s``."""
    if not (every_s > 0 and learners >= 1):
        raise ConfigError(f"round_robin: needs every_s > 0 and learners >= 1, got {every_s}, {learners}")
    start = every_s if first_s is None else first_s
    times = itertools.takewhile(lambda t: t < until_s, (start + i * every_s for i in itertools.count()))
    faults = [Fault(round(t, 3), "kill_learner", learner_name(i % learners), down_s) for i, t in enumerate(times)]
    if syncer_at_s is not None:
        faults.append(Fault(syncer_at_s, "kill_syncer", "syncer", syncer_down_s))
    return sorted(faults, key=lambda f: f.t_s)


def from_tape(outages: Iterable[Outage], scale: float, learners: int, horizon_s: float | None = None) -> list[Fault]:
    """Learner and syncer kills from a failure tape: tape seconds x ``scale`` are seconds of this run, tape
    learner L is run learner L mod ``learners`` (outages that then overlap are merged), an outage's length
    is the restart delay. Outages starting at or after ``horizon_s`` are left out. A shard's outage is
    refused: the harness kills the whole syncer."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"tape scale: must be a finite number > 0, got {scale!r}")
    outages = list(outages)
    if any(isinstance(o, SyncerOutage) and o.shard is not None for o in outages):
        raise ConfigError("tape: kill_syncer of one shard: the chaos harness kills the whole syncer only")
    mapped = merge_outages(Outage(o.learner % learners, o.down_at * scale, o.up_at * scale) if isinstance(o, Outage)
                           else SyncerOutage(o.down_at * scale, o.up_at * scale) for o in outages)
    return [Fault(round(o.down_at, 3), o.kind, learner_name(o.learner) if isinstance(o, Outage) else "syncer",
                  round(o.duration_s, 3))
            for o in mapped if horizon_s is None or o.down_at < horizon_s]


def check_schedule(cfg: RunSpec, faults: list[Fault]) -> None:
    """What a schedule needs of the config: a syncer kill is resumed from a snapshot, a fresh restart is
    refused because of one, and a full disk is seen when snapshots fail to be written."""
    for kind, why in (("kill_syncer", "kill_syncer resumes from a snapshot"),
                      ("restart_syncer_fresh", "restart_syncer_fresh is refused over snapshots, then resumes from one"),
                      ("disk_full", "disk_full fails the snapshot writes of its window")):
        if any(f.kind == kind for f in faults) and not cfg.checkpoint.every_merges:
            raise ConfigError(f"checkpoint.every_merges: {why}; set it > 0")
    for f in faults:
        m = learner_index(f.target)
        if m is not None and m >= cfg.run.learners:
            raise ConfigError(f"fault at {f.t_s} s: unknown target {f.target!r}; the run has {cfg.run.learners} learners")

