"""Chaos harness (#13): a real multi-process run under a schedule of faults, and what it cost.

A run is a ``Cluster`` (syncer + M learners as local processes, on loopback, or
in an emulated WAN's namespaces) with its folder, config and snapshots laid out
as ``launch`` does (``RUN_DIR/config.toml``, ``RUN_DIR/checkpoints``,
``RUN_DIR/metrics.jsonl``, a log per process). While it trains, faults fire at
their time (seconds after every learner logged ``start``, i.e. began training: start-up takes
seconds to minutes on a loaded machine, and a schedule should mean the same everywhere):

- ``kill_learner``: SIGKILL; restarted with ``--resume`` after ``down_s`` (default 5 s). It
  takes up its part of the snapshot the syncer resumed from when there is one, else it joins
  like a new learner.
- ``stop_learner``: SIGSTOP for ``duration_s`` (default 5 s), then SIGCONT (a hung host).
- ``kill_syncer``: SIGKILL; restarted with ``--resume`` after ``down_s``: it takes up the newest
  complete snapshot and the running learners rejoin it.
- ``cut_link``: drop every packet of a region's link for ``duration_s`` (``Emulator.cut``); only
  in an emulated run, skipped with a note otherwise.

A schedule is a JSON list of faults, or TOML ``[[fault]]`` entries, each
``{t_s, kind, target, down_s | duration_s}`` (``load_schedule``); or it is made
by ``round_robin`` (a learner killed every N seconds plus one syncer kill) or
from a failure tape of ``wan-diloco goodput --tape`` (``from_tape``).

Everything the run did is kept in a ``RunRecord`` (every process's events,
when each process lived, when each fault fired) which ``analyze`` turns into
the report; see its docstring for how each figure is defined.
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import os
import queue
import secrets
import signal
import statistics
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

from wan_diloco.config import ConfigError
from wan_diloco.planning.tape import Outage, merge_outages
from wan_diloco.runtime.launch import Cluster, emulated_spec, run_spec, write_config
from wan_diloco.spec import TOKEN_ENV, RunSpec

KINDS = ("kill_learner", "stop_learner", "kill_syncer", "cut_link")
# Each kind's one optional duration key: how long the fault lasts before the harness undoes it.
HOLD_KEY = {"kill_learner": "down_s", "kill_syncer": "down_s", "stop_learner": "duration_s", "cut_link": "duration_s"}
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
    if kind == "kill_syncer":
        if target not in (None, "syncer"):
            raise ConfigError(f"{where}.target: kill_syncer hits 'syncer', got {target!r}")
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
    """Learner kills from a failure tape: tape seconds x ``scale`` are seconds of this run, tape learner L
    is run learner L mod ``learners`` (outages that then overlap are merged), an outage's length is the
    restart delay. Outages starting at or after ``horizon_s`` are left out."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"tape scale: must be a finite number > 0, got {scale!r}")
    mapped = merge_outages(Outage(o.learner % learners, o.down_at * scale, o.up_at * scale) for o in outages)
    return [Fault(round(o.down_at, 3), "kill_learner", learner_name(o.learner), round(o.duration_s, 3))
            for o in mapped if horizon_s is None or o.down_at < horizon_s]


def check_schedule(cfg: RunSpec, faults: list[Fault]) -> None:
    """What a schedule needs of the config: a syncer kill is resumed from a snapshot."""
    if any(f.kind == "kill_syncer" for f in faults) and not cfg.checkpoint.every_merges:
        raise ConfigError("checkpoint.every_merges: kill_syncer resumes from a snapshot; set it > 0")
    for f in faults:
        m = learner_index(f.target)
        if m is not None and m >= cfg.run.learners:
            raise ConfigError(f"fault at {f.t_s} s: unknown target {f.target!r}; the run has {cfg.run.learners} learners")


# ---- what a run did -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a chaos run did, as plain JSON-able data: ``events`` are every process's JSON lines with
    ``source`` (wall-clock ``t`` and ``pid`` from the process); ``procs`` one entry per process
    started (name, pid, spawn_t, exit_t, exit_code, killed); ``faults`` each fault as it fired
    (``fired_t``, ``undone_t``, ``skipped``: why it was not applied). Times are wall-clock seconds;
    ``t0`` is when every learner had logged ``start`` (imported, compiled, joined: training began), the
    zero of fault times."""

    t0: float
    t_end: float
    learners: int
    steps: int
    events: list
    procs: list
    faults: list
    error: str | None = None
    run_dir: str = ""
    tokens_per_step: int = 0  # one learner step: batch_size x seq_len predicted positions

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        return cls(**json.loads(text))


@dataclasses.dataclass(frozen=True)
class ChaosOptions:
    timeout_s: float = 1800.0  # the run after the learners started, faults included; then every process is stopped
    start_timeout_s: float = 300.0  # for every learner to log "start" (fault times count from then)
    poll_s: float = 0.1
    emulate: bool = False  # processes in an emulated WAN's namespaces (root); needed for cut_link
    emulator_prefix: str = "wdlc"
    status_every_s: float = 15.0  # a progress note this often
    # After the syncer's final sync, a learner still running this long (say one restarted just before the
    # end, waiting for a syncer that is gone) is killed rather than waited for through its retry budget.
    end_grace_s: float = 20.0


class _Spawner:
    """One thread, alive as long as the cluster, for starts that block (a syncer restart waits until it
    listens) while the driver goes on. Not a thread per restart: ``Cluster`` children get SIGTERM when
    the thread that forked them exits (PR_SET_PDEATHSIG), so a short-lived thread would stop its syncer."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="chaos-spawner", daemon=True)

    def __enter__(self) -> "_Spawner":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.jobs.put(None)
        self.thread.join(200)  # a start in flight fails fast once the cluster stopped its process

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


class _Driver:
    """Runs one Cluster through a fault schedule (see the module docstring)."""

    def __init__(self, cluster: Cluster, spawner: "_Spawner", cfg: RunSpec, faults: list[Fault], metrics, note: Note,
                 emu=None):
        self.cluster, self.spawner, self.cfg, self.faults = cluster, spawner, cfg, faults
        self.metrics, self.note, self.emu = metrics, note, emu
        self.events: list[dict] = []
        self.procs: dict[int, dict] = {}  # pid -> entry of RunRecord.procs
        self.fired: list[dict] = []
        self.actions: list = []  # heap of (due wall time, seq, callable)
        self.seq = itertools.count()
        self.spawned: queue.Queue = queue.Queue()  # (child, spawn_t) from the spawner thread
        self.syncer_restarting = False
        self.stopped: set[int] = set()  # pids under SIGSTOP
        self.cut: set[str] = set()
        self.error: str | None = None
        self.t0 = 0.0
        self.final_seen = False
        self.final_t: float | None = None
        self.finishing_seen = False
        self.restarts_due = 0  # learners killed and not restarted yet

    # ---- bookkeeping ----------------------------------------------------------------

    def _register(self, child, spawn_t: float) -> None:
        self.procs[child.proc.pid] = {"name": child.name, "pid": child.proc.pid, "spawn_t": spawn_t,
                                      "exit_t": None, "exit_code": None, "killed": False}

    def _at(self, due_t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.actions, (due_t, next(self.seq), action))

    def _current(self, name: str) -> dict | None:
        """The newest process of ``name``."""
        mine = [p for p in self.procs.values() if p["name"] == name]
        return max(mine, key=lambda p: p["spawn_t"]) if mine else None

    def _log(self, name: str, e: dict) -> None:
        row = {"source": name, **e}
        self.events.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        kind = e.get("event")
        if name == "syncer" and kind == "final" and not self.final_seen:
            self.final_seen, self.final_t = True, time.time()
        self.finishing_seen |= kind == "finishing"

    def _say(self, text: str) -> None:
        self.note(f"[{time.time() - self.t0:7.1f} s] {text}")

    # ---- the loop ---------------------------------------------------------------------

    def run(self, options: ChaosOptions) -> RunRecord:
        t = time.time()
        try:
            self._register(self.cluster.start_syncer(), t)
        except RuntimeError as e:
            return self._record(time.time(), f"the syncer did not start: {e}")
        for m in range(self.cfg.run.learners):
            self._register(self.cluster.start_learner(m), time.time())
        self.t0 = time.time()
        if not self._wait_for_training(options.start_timeout_s):
            self._undo_all()
            return self._record(time.time(), self.error)
        self.t0 = time.time()
        for f in self.faults:
            self._at(self.t0 + f.t_s, lambda f=f: self._fire(f))
        deadline, next_status = time.monotonic() + options.timeout_s, time.monotonic() + options.status_every_s
        try:
            while not self._done():
                self._drain(options.poll_s)
                self._run_due()
                self._poll_exits()
                self._end_stragglers(options.end_grace_s)
                if time.monotonic() > deadline:
                    self.error = f"timed out after {options.timeout_s:.0f} s; every process was stopped"
                if time.monotonic() > next_status:
                    next_status += options.status_every_s
                    self._status()
        finally:
            self._undo_all()
        self._drain(0.0)
        return self._record(time.time(), self.error)

    def _wait_for_training(self, timeout_s: float) -> bool:
        """Until every learner logged ``start`` (imported, compiled, joined): fault times count from then,
        so that a schedule means the same on a loaded machine, where start-up takes tens of seconds."""
        deadline = time.monotonic() + timeout_s
        while len({e["source"] for e in self.events if e.get("event") == "start"}) < self.cfg.run.learners:
            self._drain(0.1)
            self._poll_exits()
            if any(p["exit_t"] is not None for p in self.procs.values()) and not self.error:
                self.error = "a process exited before every learner started; see the logs in " + str(self.cluster.run_dir)
            if time.monotonic() > deadline and not self.error:
                self.error = f"the learners did not all start within {timeout_s:.0f} s"
            if self.error:
                return False
        return True

    def _done(self) -> bool:
        if self.error:
            return True
        learners = [p for p in self.procs.values() if p["name"] != "syncer"]
        # Learners that finished exit 0, maybe before the syncer's final event is read: only failures count.
        if not self.restarts_due and all(p["exit_t"] is not None and p["exit_code"] != 0 for p in learners):
            self.error = "every learner exited before the end of the run; see their logs"
            return True
        if self.syncer_restarting or not self.final_seen:
            return False
        # The syncer's final sync is over: wait for every process to exit (restarts still due are dropped).
        return all(p["exit_t"] is not None for p in self.procs.values())

    def _drain(self, block_s: float) -> None:
        while True:
            try:
                name, e = self.cluster.events.get(timeout=block_s) if block_s else self.cluster.events.get_nowait()
            except queue.Empty:
                break
            block_s = 0.0
            if "pid" in e:  # the reader's own "exit" marker has none; exits are polled instead
                self._log(name, e)
        while not self.spawned.empty():
            self._register(*self.spawned.get())

    def _run_due(self) -> None:
        while self.actions and self.actions[0][0] <= time.time() and not self.error:
            _, _, action = heapq.heappop(self.actions)
            action()

    def _poll_exits(self) -> None:
        for p in self.procs.values():
            if p["exit_t"] is not None:
                continue
            child = self.cluster.children.get(p["name"])
            if child is None or child.proc.pid != p["pid"] or child.exit_code is None:
                continue
            p.update(exit_t=time.time(), exit_code=child.exit_code)
            if p["name"] == "syncer" and child.exit_code != 0:
                self.error = f"the syncer died (exit code {child.exit_code}); see {child.log_path}"
            elif child.exit_code != 0:
                self._say(f"{p['name']} exited with code {child.exit_code} (see {child.log_path})")

    def _end_stragglers(self, grace_s: float) -> None:
        if self.final_t is None or time.time() - self.final_t < grace_s:
            return
        for p in list(self.procs.values()):
            if p["exit_t"] is None:
                self._say(f"{p['name']} still running {grace_s:g} s after the final sync: killed")
                self._kill(p["name"])

    def _status(self) -> None:
        prog = next((e for e in reversed(self.events) if e["source"] == "syncer" and e.get("event") == "progress"), None)
        if prog is not None:
            self._say(f"global step {prog.get('global_step')} / {self.cfg.run.steps}, versions {prog.get('versions')}, "
                      f"live learners {prog.get('alive')}")

    # ---- faults ---------------------------------------------------------------------

    def _fire(self, f: Fault) -> None:
        entry = {**f.to_dict(), "fired_t": time.time(), "undone_t": None, "skipped": None, "pid": None}
        self.fired.append(entry)
        why = self._why_not(f)
        if why:
            entry["skipped"] = why
            self._say(f"{f.kind} {f.target}: skipped ({why})")
            return
        self._say(f"{f.kind} {f.target}" + (f" for {f.hold_s:g} s" if f.hold_s else ""))
        getattr(self, f"_{f.kind}")(f, entry)

    def _why_not(self, f: Fault) -> str | None:
        if self.final_seen or self.finishing_seen:
            return "the run is already in its final sync"
        if f.kind == "cut_link":
            if self.emu is None:
                return "cut_link needs the emulated WAN (--emulate, root); on loopback there is no link to cut"
            return "the link is cut already" if self._region(f.target) in self.cut else None
        if f.kind == "kill_syncer":
            return "the syncer is down already" if self.syncer_restarting or not self.spawned.empty() else None
        proc = self._current(f.target)
        if proc is None or proc["exit_t"] is not None:
            return f"{f.target} is not running"
        return f"{f.target} is stopped already" if f.kind == "stop_learner" and proc["pid"] in self.stopped else None

    def _kill(self, name: str) -> dict:
        proc = self._current(name)
        proc["killed"] = True
        self.stopped.discard(proc["pid"])  # SIGKILL ends a stopped process too
        self.cluster.kill(name, signal.SIGKILL)
        proc.update(exit_t=time.time(), exit_code=self.cluster.children[name].exit_code)
        return proc

    def _kill_learner(self, f: Fault, entry: dict) -> None:
        entry["pid"] = self._kill(f.target)["pid"]
        self.restarts_due += 1
        self._at(time.time() + f.hold_s, lambda: self._restart_learner(f.target, entry))

    def _restart_learner(self, name: str, entry: dict) -> None:
        entry["undone_t"] = time.time()
        self.restarts_due -= 1
        if self.final_seen:
            self._say(f"{name}: not restarted (the run is over)")
            return
        t = time.time()
        self._register(self.cluster.start_learner(learner_index(name), resume=True), t)
        self._say(f"{name} restarted (--resume)")

    def _stop_learner(self, f: Fault, entry: dict) -> None:
        pid = entry["pid"] = self._current(f.target)["pid"]
        os.killpg(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        self._at(time.time() + f.hold_s, lambda: self._continue(pid, f.target, entry))

    def _continue(self, pid: int, name: str, entry: dict) -> None:
        entry["undone_t"] = time.time()
        self.stopped.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
        self._say(f"{name} continued (SIGCONT)")

    def _kill_syncer(self, f: Fault, entry: dict) -> None:
        entry["pid"] = self._kill("syncer")["pid"]
        self.syncer_restarting = True
        self._at(time.time() + f.hold_s, lambda: self._restart_syncer(entry))

    def _restart_syncer(self, entry: dict) -> None:
        """On the spawner thread: start_syncer blocks until the new syncer listens (seconds), and faults
        keep firing meanwhile."""
        def restart() -> None:
            t = time.time()
            try:
                self.spawned.put((self.cluster.start_syncer(resume=True), t))
                self._say("syncer restarted (--resume)")
            except RuntimeError as e:
                self.error = f"the syncer could not resume: {e}"
            entry["undone_t"] = t
            self.syncer_restarting = False

        self.spawner.submit(restart)

    def _region(self, target: str) -> str:
        m = learner_index(target)
        return self.cfg.region(m) if m is not None else target

    def _cut_link(self, f: Fault, entry: dict) -> None:
        region = self._region(f.target)
        self.emu.cut(region)
        self.cut.add(region)
        self._at(time.time() + f.hold_s, lambda: self._restore_link(region, entry))

    def _restore_link(self, region: str, entry: dict) -> None:
        entry["undone_t"] = time.time()
        if region in self.cut:
            self.cut.discard(region)
            self.emu.cut(region, down=False)
            self._say(f"link of {region} restored")

    def _undo_all(self) -> None:
        """Leave nothing stopped or cut behind, whatever ended the run (stop_all cannot end a stopped process
        with SIGTERM, and a cut link would outlive the run in a shared emulator)."""
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
        self.stopped.clear()
        for region in list(self.cut):
            with contextlib.suppress(Exception):
                self.emu.cut(region, down=False)
        self.cut.clear()
        deadline = time.monotonic() + 200  # a syncer restart in flight ends (start_syncer's own timeout is 180 s)
        while self.syncer_restarting and time.monotonic() < deadline:
            time.sleep(0.1)

    def _record(self, t_end: float, error: str | None) -> RunRecord:
        while not self.spawned.empty():
            self._register(*self.spawned.get())
        for p in self.procs.values():  # still running at the end: the cluster stops them now
            if p["exit_t"] is None:
                p["exit_t"] = t_end
        # Sorted by the processes' own clocks: the readers' queue interleaves them with some delay.
        return RunRecord(t0=self.t0 or t_end, t_end=t_end, learners=self.cfg.run.learners, steps=self.cfg.run.steps,
                         events=sorted(self.events, key=lambda e: e.get("t", 0.0)),
                         procs=sorted(self.procs.values(), key=lambda p: p["spawn_t"]),
                         faults=self.fired, error=error, run_dir=str(self.cluster.run_dir),
                         tokens_per_step=self.cfg.run.batch_size * self.cfg.model.seq_len)


def run_chaos(cfg: RunSpec, faults: list[Fault], run_dir: str | Path, options: ChaosOptions = ChaosOptions(),
              note: Note = lambda s: None, token: str | None = None) -> RunRecord:
    """Run ``cfg`` to its end under ``faults`` in ``run_dir`` (created); returns what happened. Every
    process is stopped when this returns, also on errors (``RunRecord.error`` says why a run ended early).
    The record is also written to ``RUN_DIR/chaos_record.json``."""
    check_schedule(cfg, faults)
    rdir = Path(run_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    cfg = run_spec(cfg, rdir)
    token = token or cfg.run.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        emu, wrap = None, None
        if options.emulate:
            from wan_diloco.regions import Emulator

            emu = stack.enter_context(Emulator(cfg.regions, prefix=options.emulator_prefix))
            cfg = emulated_spec(cfg, emu, rdir / "tls")
            wrap = lambda name: emu.netns_argv(  # noqa: E731
                cfg.regions.syncer_region if name == "syncer" else cfg.region(learner_index(name)))
        write_config(rdir / "config.toml", cfg)
        metrics = stack.enter_context(open(rdir / "metrics.jsonl", "w"))
        spawner = stack.enter_context(_Spawner())  # entered before the cluster: it ends after the children
        cluster = stack.enter_context(Cluster(cfg, rdir / "config.toml", rdir, token=token, wrap=wrap))
        record = _Driver(cluster, spawner, cfg, faults, metrics, note, emu).run(options)
    (rdir / "chaos_record.json").write_text(record.to_json())
    return record


# ---- the report ---------------------------------------------------------------------------------

def _of(record: RunRecord, source: str | None = None, kind: str | None = None) -> list[dict]:
    return [e for e in record.events if (source is None or e["source"] == source)
            and (kind is None or e.get("event") == kind)]


def _is_learner(source: str) -> bool:
    return learner_index(source) is not None


def merge_times(record: RunRecord) -> list[float]:
    """When the syncer was seen merging: progress events whose versions grew since the previous one of the
    same syncer process (the first of a resumed syncer is compared with the snapshot it resumed)."""
    times, last = [], {}
    for e in _of(record, "syncer"):
        kind, pid = e.get("event"), e.get("pid")
        if kind == "listening":
            last[pid] = sum((e.get("resumed") or {}).get("versions") or [0])
        elif kind == "progress" and "versions" in e:
            total = sum(e["versions"])
            if total > last.get(pid, 0):
                times.append(e["t"])
            last[pid] = total
    return sorted(times)


def training_end(record: RunRecord) -> float:
    """When training was over: the first learner's ``finishing`` (the final sync is not training), else the
    syncer's final event, else the end of the record."""
    for kind, source in (("finishing", None), ("final", "syncer")):
        times = [e["t"] for e in _of(record, source, kind)]
        if times:
            return min(times)
    return record.t_end


def merge_uptime(times: list[float], end: float, min_window_s: float = 3.0) -> tuple[float, float]:
    """(uptime, window) over [first merge, ``end``]: the share of it not inside a gap between merges (or
    from the last merge to ``end``) longer than the window, max(``min_window_s``, 3 x the median gap);
    0 with fewer than two merges."""
    times = [t for t in times if t <= end]
    if len(times) < 2 or end <= times[0]:
        return 0.0, min_window_s
    gaps = [b - a for a, b in zip(times, times[1:])]
    window = max(min_window_s, 3 * statistics.median(gaps))
    down = sum(g for g in gaps + [end - times[-1]] if g > window)
    return 1.0 - down / (end - times[0]), window


def _union_s(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def alive_uptime(record: RunRecord) -> float:
    """1 - (time the syncer was down or no learner was training) / wall time from t0 to ``training_end``.
    A learner trains from its ``start`` event until it exits; the syncer is up from ``listening`` until
    it exits."""
    end = training_end(record)
    up: dict[str, list] = {"syncer": [], "learners": []}
    for p in record.procs:
        ready = next((e["t"] for e in record.events if e.get("pid") == p["pid"]
                      and e.get("event") in ("listening", "start")), None)
        if ready is not None:
            up["syncer" if p["name"] == "syncer" else "learners"].append((ready, p["exit_t"] or record.t_end))
    wall = max(1e-9, end - record.t0)
    syncer_up = _union_s(up["syncer"], record.t0, end)
    # Up = syncer up and some learner training: |S ∩ L| = |S| + |L| - |S ∪ L|.
    learners_up = _union_s(up["learners"], record.t0, end)
    both = syncer_up + learners_up - _union_s(up["syncer"] + up["learners"], record.t0, end)
    return both / wall


def step_time_s(record: RunRecord) -> float | None:
    """Median seconds per step between consecutive step events of one learner process."""
    rates, last = [], {}
    for e in record.events:
        if e.get("event") != "step" or not _is_learner(e["source"]):
            continue
        prev = last.get(e["pid"])
        if prev is not None and e["step"] > prev["step"] and e["t"] > prev["t"]:
            rates.append((e["t"] - prev["t"]) / (e["step"] - prev["step"]))
        last[e["pid"]] = e
    return statistics.median(rates) if rates else None


def _first(record: RunRecord, pred: Callable[[dict], bool]) -> dict | None:
    return next((e for e in record.events if pred(e)), None)


def _versions(e: dict | None) -> int:
    return sum(e.get("versions") or []) if e else 0


def recovered_s(record: RunRecord, fault: dict) -> float | None:
    """Seconds from a fault until the run had it behind it (see ``analyze``); None if never."""
    if fault.get("skipped"):
        return None
    t, kind, target = fault["fired_t"], fault["kind"], fault["target"]
    if kind == "kill_learner":
        back = _first(record, lambda e: e["source"] == target and e.get("event") == "step" and e["t"] > t
                      and e.get("pid") != fault.get("pid"))
    elif kind == "stop_learner":
        cont = fault.get("undone_t") or t
        back = _first(record, lambda e: e["source"] == target and e.get("event") == "step" and e["t"] > cont)
    elif kind == "kill_syncer":
        back = _syncer_back(record, fault)
    else:
        back = _link_back(record, fault)
    return round(back["t"] - t, 3) if back else None


def _syncer_back(record: RunRecord, fault: dict) -> dict | None:
    """The first merge of a syncer started after the kill (its versions above the resumed snapshot's)."""
    listening = _first(record, lambda e: e["source"] == "syncer" and e.get("event") == "listening"
                       and e["t"] > fault["fired_t"] and e.get("pid") != fault.get("pid"))
    if listening is None:
        return None
    base = sum((listening.get("resumed") or {}).get("versions") or [0])
    return _first(record, lambda e: e.get("pid") == listening["pid"] and e["t"] >= listening["t"] and (
        (e.get("event") == "progress" and _versions(e) > base) or e.get("event") == "final"))


def _link_back(record: RunRecord, fault: dict) -> dict | None:
    """cut_link: the last of the affected learners (those in the cut region; every learner when none is,
    as for the syncer's region) to receive a newer version after the link was restored."""
    t, restored = fault["fired_t"], fault.get("undone_t") or fault["fired_t"]
    regions = {e["source"]: e.get("region") for e in _of(record, kind="start") if _is_learner(e["source"])}
    region = regions.get(fault["target"], fault["target"])  # learner-N: its region
    names = sorted(n for n, r in regions.items() if r == region) or sorted(regions)
    backs = []
    for name in names:
        before = [e for e in _of(record, name, "step") if e["t"] <= t]
        seen = _versions(before[-1]) if before else 0
        back = _first(record, lambda e: e["source"] == name and e.get("event") == "step" and e["t"] > restored
                      and _versions(e) > seen)
        if back is None:
            return None
        backs.append(back)
    return max(backs, key=lambda e: e["t"]) if backs else None


def _generations(record: RunRecord, name: str) -> list[dict]:
    return [p for p in record.procs if p["name"] == name]


def goodput(record: RunRecord) -> float:
    """Σ compute seconds of every learner process / Σ over learner slots of the wall time it was supposed
    to train (its first process's ``start`` to its last process's ``finishing``, or the end)."""
    compute, supposed = 0.0, 0.0
    for m in range(record.learners):
        gens, first_start, end = _generations(record, learner_name(m)), None, None
        for p in gens:
            mine = [e for e in record.events if e.get("pid") == p["pid"]]
            start = next((e["t"] for e in mine if e.get("event") == "start"), None)
            final = next((e for e in mine if e.get("event") == "final"), None)
            steps = [e["t"] for e in mine if e.get("event") == "step"]
            if start is not None and first_start is None:
                first_start = start
            if final is not None:
                compute += final["compute_s"]
            elif start is not None and steps:
                compute += steps[-1] - start  # a killed process: trained from its start to its last report
            finishing = next((e["t"] for e in mine if e.get("event") == "finishing"), None)
            end = finishing or p["exit_t"] or end
        if first_start is not None:
            supposed += max(0.0, (end or record.t_end) - first_start)
    return compute / supposed if supposed else 0.0


def recovery_bytes(record: RunRecord) -> int:
    """Bytes received for recovery: a restarted learner's ``bytes_received`` at its ``start`` event (the
    bulk fetch of every fragment at its join, plus its first link probe), and for a learner rejoining a
    resumed syncer, its ``bytes_received`` growth from the last step event before its ``rejoin`` to the
    first after it (the bulk fetch, plus the updates of that interval: an upper bound)."""
    total = 0
    for m in range(record.learners):
        for p in _generations(record, learner_name(m))[1:]:
            start = _first(record, lambda e: e.get("pid") == p["pid"] and e.get("event") == "start")
            total += int(start.get("bytes_received", 0)) if start else 0
    for rj in _of(record, kind="rejoin"):
        mine = [e for e in record.events if e.get("pid") == rj["pid"] and e.get("event") in ("step", "start")]
        before = [e for e in mine if e["t"] <= rj["t"] and "bytes_received" in e]
        after = next((e for e in mine if e["t"] > rj["t"] and "bytes_received" in e), None)
        if after is not None:
            total += int(after["bytes_received"]) - (int(before[-1]["bytes_received"]) if before else 0)
    return total


def rolled_back_steps(record: RunRecord) -> int:
    """Σ over syncer resumes and the learner processes training then: the learner's step when it took up the
    snapshot (its ``rejoin``; or its last step report, if it was killed before it rejoined) minus the
    snapshot's global step. What it trained since the snapshot (merged or not) is replaced by the snapshot.
    A learner that joined the resumed syncer directly (restarted during the outage) lost nothing there."""
    resumes = [e for e in _of(record, "syncer", "listening") if e.get("resumed")]
    starts = sorted(e["t"] for e in _of(record, "syncer", "listening"))
    lost = 0
    for res in resumes:
        t, snap_step = res["t"], int(res["resumed"].get("global_step", 0))
        until = next((x for x in starts if x > t), math.inf)  # the next syncer process, if any
        for p in record.procs:
            if p["name"] == "syncer" or p["spawn_t"] > t or (p["exit_t"] or math.inf) <= t:
                continue
            step = _step_at_resume(record, p, t, until)
            lost += max(0, step - snap_step) if step is not None else 0
    return lost


def _step_at_resume(record: RunRecord, proc: dict, t: float, until: float) -> int | None:
    mine = [e for e in record.events if e.get("pid") == proc["pid"]]
    rejoin = next((e for e in mine if e.get("event") == "rejoin" and t <= e["t"] < until), None)
    if rejoin is not None:
        return int(rejoin.get("step", 0))
    trained_before = any(e.get("event") == "step" and e["t"] <= t for e in mine)
    if trained_before and (proc["exit_t"] or math.inf) < until:  # killed before it rejoined
        steps = [e["step"] for e in mine if e.get("event") == "step" and e["t"] <= proc["exit_t"]]
        return int(steps[-1])
    return None  # joined the resumed syncer directly (or never trained): nothing of it was rolled back


def tokens_trained(record: RunRecord) -> int:
    """Tokens every learner process trained on: its last report (step or final) minus its first step report,
    plus that first step (``tokens_per_step``). A learner's own counter restarts with each process, or
    at a snapshot's count, so the final events alone undercount a run with restarts."""
    total = 0
    for p in record.procs:
        reports = [e for e in record.events if e.get("pid") == p["pid"] and e.get("event") in ("step", "final")
                   and "tokens" in e]
        if reports and reports[0]["event"] == "step":
            total += int(reports[-1]["tokens"]) - int(reports[0]["tokens"]) + record.tokens_per_step
    return total


def learner_down_s(record: RunRecord, faults: list[dict]) -> float:
    """Σ per learner of the union of [fault, recovery] of its kills and stops (never recovered: to the end)."""
    spans: dict[str, list] = {}
    for f in faults:
        if f.get("skipped") or f["kind"] not in ("kill_learner", "stop_learner"):
            continue
        r = f.get("recovered_s")
        spans.setdefault(f["target"], []).append((f["fired_t"], f["fired_t"] + r if r is not None else record.t_end))
    return sum(_union_s(s, record.t0, record.t_end) for s in spans.values())


def _learner_finals(record: RunRecord) -> list[dict]:
    """The final event of each learner slot's last process (the one that finished the run)."""
    out = []
    for m in range(record.learners):
        gens = _generations(record, learner_name(m))
        final = _first(record, lambda e: gens and e.get("pid") == gens[-1]["pid"] and e.get("event") == "final")
        if final is not None:
            out.append(final)
    return out


def final_eval_loss(record: RunRecord) -> float | None:
    finals = _learner_finals(record)
    return sum(f["final_eval_loss"] for f in finals) / len(finals) if finals else None


def finished(record: RunRecord) -> bool:
    """The run ended as a run should: no error, the syncer's final sync done, every learner slot final."""
    return (record.error is None and bool(_of(record, "syncer", "final"))
            and len(_learner_finals(record)) == record.learners)


def snapshot_interval_s(record: RunRecord) -> float | None:
    times = sorted(e["t"] for e in _of(record, "syncer", "snapshot"))
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def analyze(record: RunRecord, baseline: RunRecord | None = None, min_window_s: float = 3.0) -> dict:
    """The chaos report of a run (and its fault-free twin, if run). Definitions:

    - ``faults[].recovered_s``: seconds from the fault until the run has it behind it, None if never:
      a killed learner: until a restarted process of it logs a ``step``; a stopped learner: until it
      logs a ``step`` after SIGCONT; the syncer: until a syncer started after the kill has resumed
      and merged (a ``progress`` event with versions above its snapshot's, or its final event);
      a cut link: until every learner behind it received a newer version after the link came back.
    - ``uptime``: share of the training span (first merge to the first learner's ``finishing``,
      ``training_end``) during which the syncer was merging: time not inside a gap between merges
      (``merge_times``: progress events whose versions grew) longer than max(3 s, 3 x the median gap)
      (``merge_uptime``). ``notes.uptime_alive`` is the other definition: 1 - (syncer down or no
      learner training) / wall from t0 to the end of training (``alive_uptime``).
    - ``goodput``: Σ learner compute seconds / Σ wall seconds the learner slots were supposed to train,
      as in ``launch.summarize``; a killed process counts its start-to-last-step time as compute, the
      time until its restart is stepping again is lost. Rolled-back work is not subtracted (see lost_s).
    - ``recovery_bytes``: ``recovery_bytes`` (restart joins + rejoins after a syncer resume).
    - ``final_eval_loss``: mean final eval loss of the learners' last processes; ``fault_free_eval_loss``
      the same for the fault-free run of the same config and step budget (equal global steps: the
      faulty run trained fewer tokens, ``notes.tokens``, ``tokens_trained``); ``loss_ratio`` the first
      over the second.
    - ``syncer_resumes``: syncer processes started with a resumed snapshot.
    - ``snapshot_interval_s``: mean time between the syncer's complete-snapshot events.
    - ``lost_s``: learner-seconds of training lost: each learner's time from a kill or stop until it
      stepped again, plus rolled-back steps (``rolled_back_steps``) x the median step time.
    """
    faults = [{**f, "recovered_s": recovered_s(record, f)} for f in record.faults]
    up, window = merge_uptime(merge_times(record), training_end(record), min_window_s)
    step_s = step_time_s(record)
    rolled = rolled_back_steps(record)
    lost = learner_down_s(record, faults) + rolled * (step_s or 0.0)
    loss = final_eval_loss(record)
    base = final_eval_loss(baseline) if baseline is not None else None
    tokens = lambda r: tokens_trained(r) if r is not None else None  # noqa: E731
    report = {
        "faults": [{"t_s": round(f["t_s"], 3), "kind": f["kind"], "target": f["target"],
                    "recovered_s": f["recovered_s"]} for f in faults],
        "uptime": _round(up), "goodput": _round(goodput(record)), "recovery_bytes": recovery_bytes(record),
        "final_eval_loss": _round(loss, 5), "fault_free_eval_loss": _round(base, 5),
        "loss_ratio": _round(loss / base, 5) if loss is not None and base else None,
        "syncer_resumes": sum(1 for e in _of(record, "syncer", "listening") if e.get("resumed")),
        "snapshot_interval_s": _round(snapshot_interval_s(record), 3), "lost_s": _round(lost, 3),
        "notes": {
            "finished": finished(record), "error": record.error,
            "baseline_finished": finished(baseline) if baseline is not None else None,
            "wall_s": round(record.t_end - record.t0, 3),
            "baseline_wall_s": round(baseline.t_end - baseline.t0, 3) if baseline is not None else None,
            "uptime_alive": _round(alive_uptime(record)), "uptime_window_s": round(window, 3),
            "step_s": _round(step_s), "rolled_back_steps": rolled,
            "tokens": tokens(record), "baseline_tokens": tokens(baseline),
            "skipped": [f"{f['kind']} {f['target']} at {f['t_s']} s: {f['skipped']}" for f in faults if f["skipped"]],
            "actual_fault_t_s": [round(f["fired_t"] - record.t0, 3) for f in faults],
            "run_dir": record.run_dir,
        },
    }
    report["notes"]["targets"] = targets(report, faults)
    return report


def targets(report: dict, faults: list[dict], min_uptime: float = 0.9, max_loss_gap: float = 0.02) -> dict:
    """The issue's targets, measured: the run finished, every applied fault recovered, uptime, loss gap."""
    ratio = report.get("loss_ratio")
    return {
        "finished": bool(report["notes"]["finished"]),
        "every_fault_recovered": all(f["recovered_s"] is not None for f in faults if not f.get("skipped")),
        f"uptime>={min_uptime}": report["uptime"] is not None and report["uptime"] >= min_uptime,
        f"loss_within_{max_loss_gap:.0%}": ratio is not None and abs(ratio - 1.0) <= max_loss_gap,
    }


# ---- the picture --------------------------------------------------------------------------------

FAULT_COLORS = {"kill_learner": "tab:red", "stop_learner": "tab:orange", "kill_syncer": "tab:purple",
                "cut_link": "tab:blue"}


def plot_timeline(record: RunRecord, path: str | Path, baseline: RunRecord | None = None, title: str = "") -> None:
    """PNG: one row per process name (each process started: starting light, up green), fault markers (X at
    the fault, a bar until it was undone), and below it the global step over time (syncer progress; the
    fault-free run dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["syncer"] + [learner_name(m) for m in range(record.learners)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2.2 + 0.45 * len(names) + 2.5), sharex=True,
                                      gridspec_kw={"height_ratios": [len(names) * 0.6 + 0.8, 2.5]})
    _process_rows(top, record, names)
    _fault_marks(top, bottom, record)
    _step_lines(bottom, record, "with faults", "tab:green", "-")
    if baseline is not None:
        _step_lines(bottom, baseline, "fault-free", "gray", "--")
    bottom.set_xlabel("seconds since every learner started training (t_s = 0 of the faults)")
    bottom.set_ylabel("global step")
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    top.set_title(title or "chaos run: processes, faults and the global step")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _process_rows(ax, record: RunRecord, names: list[str]) -> None:
    for row, name in enumerate(names):
        for p in _generations(record, name):
            ready = _first(record, lambda e: e.get("pid") == p["pid"] and e.get("event") in ("listening", "start"))
            end = p["exit_t"] or record.t_end
            t_ready = ready["t"] if ready else end
            ax.broken_barh([(p["spawn_t"] - record.t0, t_ready - p["spawn_t"])], (row - 0.3, 0.6),
                           facecolors="lightsteelblue")
            ax.broken_barh([(t_ready - record.t0, max(0.0, end - t_ready))], (row - 0.3, 0.6), facecolors="tab:green")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color="lightsteelblue", label="starting (import, compile, join)"), Patch(color="tab:green", label="up")]
    handles += [Patch(color=c, label=k) for k, c in FAULT_COLORS.items()
                if any(f["kind"] == k and not f.get("skipped") for f in record.faults)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=4, fontsize=8, frameon=False)


def _fault_marks(top, bottom, record: RunRecord) -> None:
    rows = {"syncer": 0, **{learner_name(m): m + 1 for m in range(record.learners)}}
    for f in record.faults:
        if f.get("skipped"):
            continue
        x, color = f["fired_t"] - record.t0, FAULT_COLORS[f["kind"]]
        end = (f.get("undone_t") or f["fired_t"]) - record.t0
        row = rows.get(f["target"], 0)
        top.plot([x], [row], marker="X", color=color, markersize=10, markeredgecolor="black")
        top.hlines(row + 0.38, x, end, colors=color, linewidth=3)
        for ax in (top, bottom):
            ax.axvline(x, color=color, linestyle=":", alpha=0.7)


def _step_lines(ax, record: RunRecord, label: str, color: str, style: str) -> None:
    pids = []
    for e in _of(record, "syncer", "progress"):
        if e["pid"] not in pids:
            pids.append(e["pid"])
    for i, pid in enumerate(pids):
        pts = [(e["t"] - record.t0, e.get("global_step", 0)) for e in _of(record, "syncer", "progress") if e["pid"] == pid]
        ax.plot(*zip(*pts), color=color, linestyle=style, label=label if i == 0 else None)


def write_report(report: dict, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=1) + "\n")


def config_summary(cfg: RunSpec) -> dict:
    """The settings a chaos report is read against."""
    return {"learners": cfg.run.learners, "steps": cfg.run.steps, "min_step_s": cfg.run.min_step_s,
            "preset": cfg.preset, "model": dataclasses.asdict(cfg.model),
            "sync_every": cfg.learner.sync_every, "num_fragments": cfg.learner.num_fragments, "tau": cfg.learner.tau,
            "quorum": cfg.syncer.quorum, "every_merges": cfg.checkpoint.every_merges,
            "liveness_timeout_s": cfg.syncer.liveness_timeout_s, "retry_budget_s": cfg.transport.retry_budget_s}


def run_with_baseline(cfg: RunSpec, faults: list[Fault], run_dir: str | Path, options: ChaosOptions = ChaosOptions(),
                      baseline: bool = True, note: Note = lambda s: None,
                      png: str | Path | None = None) -> tuple[dict, RunRecord, RunRecord | None]:
    """The chaos run in ``RUN_DIR/chaos`` and (``baseline``) the same config without faults in
    ``RUN_DIR/baseline``; returns (report, chaos record, baseline record), and draws ``png``."""
    rdir = Path(run_dir)
    note(f"chaos run: {len(faults)} faults, {cfg.run.learners} learners, {cfg.run.steps} steps -> {rdir / 'chaos'}")
    record = run_chaos(cfg, faults, rdir / "chaos", options, note)
    base = None
    if baseline:
        note(f"fault-free run of the same config -> {rdir / 'baseline'}")
        base = run_chaos(cfg, [], rdir / "baseline", options, note)
    report = {**analyze(record, base), "config": config_summary(cfg)}
    if png is not None:
        plot_timeline(record, png, base)
    return report, record, base
