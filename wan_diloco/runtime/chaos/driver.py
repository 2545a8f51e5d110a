"""The chaos driver: a ``Cluster`` (``processes.py``) run to its end while faults fire at their times."""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import queue
import secrets
import signal
import time
from pathlib import Path
from typing import Callable

from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.checkpoint.format import FAULT_ENV
from wan_diloco.runtime.launch import Cluster, emulated_spec, last_line, run_spec, write_config
from wan_diloco.spec import RunSpec
from wan_diloco.runtime.chaos.processes import ChaosCluster, Spawner, disk_flag_path
from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.schedule import Fault, Note, check_schedule, learner_index


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


class _Driver:
    """Runs one Cluster through a fault schedule (see the module docstring)."""

    def __init__(self, cluster: Cluster, spawner: Spawner, cfg: RunSpec, faults: list[Fault], metrics, note: Note,
                 emu=None):
        self.cluster, self.spawner, self.cfg, self.faults = cluster, spawner, cfg, faults
        self.metrics, self.note, self.emu = metrics, note, emu
        self.events: list[dict] = []
        self.procs: dict[int, dict] = {}  # pid -> entry of RunRecord.procs
        self.fired: list[dict] = []
        self.actions: list = []  # heap of (due wall time, seq, callable)
        self.seq = itertools.count()
        self.spawned: queue.Queue = queue.Queue()  # (child, spawn_t, extra) from the spawner thread
        self.syncer_restarting = False
        self.stopped: set[int] = set()  # pids under SIGSTOP
        self.cut: set[str] = set()
        self.error: str | None = None
        self.t0 = 0.0
        self.final_seen = False
        self.final_t: float | None = None
        self.finishing_seen = False
        self.restarts_due = 0  # learners killed and not restarted yet
        self.disk_flag = disk_flag_path(cluster.run_dir)  # disk_full: the syncers' writes fail while it exists

    # ---- bookkeeping ----------------------------------------------------------------

    def _register(self, child, spawn_t: float, extra: dict | None = None) -> None:
        self.procs[child.proc.pid] = {"name": child.name, "pid": child.proc.pid, "spawn_t": spawn_t,
                                      "exit_t": None, "exit_code": None, "killed": False, **(extra or {})}

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
        if f.kind == "disk_full" and self.syncer_restarting and not self.final_seen:
            # It would stall the restart (its incarnation is written before it listens), timing that: it waits.
            return self._at(time.time() + 0.5, lambda: self._fire(f))
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
        if f.kind in ("kill_syncer", "restart_syncer_fresh"):
            if self.syncer_restarting or not self.spawned.empty():
                return "the syncer is down already"
            if f.kind == "restart_syncer_fresh" and not SnapshotStore(self.cfg.checkpoint.dir).complete_ids():
                return "checkpoint.dir holds no complete snapshot yet: nothing to refuse a fresh start over"
            return None
        if f.kind == "disk_full":
            return "the disk is full already" if self.disk_flag.exists() else None
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

    def _kill_syncer(self, f: Fault, entry: dict, fresh_first: bool = False) -> None:
        entry["pid"] = self._kill("syncer")["pid"]
        self.syncer_restarting = True
        self._at(time.time() + f.hold_s, lambda: self._restart_syncer(entry, fresh_first))

    def _restart_syncer_fresh(self, f: Fault, entry: dict) -> None:
        self._kill_syncer(f, entry, fresh_first=True)

    def _restart_syncer(self, entry: dict, fresh_first: bool = False) -> None:
        """On the spawner thread: start_syncer blocks until the new syncer listens (seconds), and faults
        keep firing meanwhile. ``fresh_first``: a start without --resume first, which must be refused."""
        def restart() -> None:
            if fresh_first and not self._start_fresh(entry):
                self.syncer_restarting = False
                return
            t = time.time()
            try:
                self.spawned.put((self.cluster.start_syncer(resume=True), t, None))
                self._say("syncer restarted (--resume)")
            except RuntimeError as e:
                self.error = f"the syncer could not resume: {e}"
            entry["undone_t"] = t
            self.syncer_restarting = False

        self.spawner.submit(restart)

    def _start_fresh(self, entry: dict) -> bool:
        """The supervisor's first try, without --resume over a folder of snapshots: refused is right (the
        exit code and the line it printed go into ``entry["refusal"]``); a syncer that listens forked the
        run, which ends it with an error."""
        t = time.time()
        try:
            child = self.cluster.start_syncer(resume=False)
        except RuntimeError as e:
            child = self.cluster.children["syncer"]
            code = child.exit_code
            line = last_line(child.log_path) if code is not None else str(e)
            entry["refusal"] = {"exit_code": code, "line": line, "pid": child.proc.pid, "t": time.time()}
            # Expected to exit: registered as exited, so that the exit is not taken for the syncer dying.
            self.spawned.put((child, t, {"exit_t": time.time(), "exit_code": code, "refused": True}))
            self._say(f"syncer started without --resume: exit code {code}: {line}")
            return True
        entry["refusal"] = {"exit_code": None, "line": None, "pid": child.proc.pid, "t": time.time()}
        self.spawned.put((child, t, None))
        self.error = "the syncer started without --resume over the run's snapshots was not refused: the run forked"
        return False

    def _disk_full(self, f: Fault, entry: dict) -> None:
        self.disk_flag.touch()
        self._at(time.time() + f.hold_s, lambda: self._disk_freed(entry))

    def _disk_freed(self, entry: dict) -> None:
        entry["undone_t"] = time.time()
        self.disk_flag.unlink(missing_ok=True)
        self._say("checkpoint disk has space again")

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
        self.disk_flag.unlink(missing_ok=True)
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
    token = token or cfg.given_token() or secrets.token_urlsafe(24)
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
        spawner = stack.enter_context(Spawner())  # entered before the cluster: it ends after the children
        # The disk_full hook only for a schedule that has the fault, and only for its syncers.
        flag = disk_flag_path(rdir)
        flag.unlink(missing_ok=True)
        syncer_env = {FAULT_ENV: str(flag)} if any(f.kind == "disk_full" for f in faults) else None
        cluster = stack.enter_context(ChaosCluster(cfg, rdir / "config.toml", rdir, token=token, wrap=wrap,
                                                    syncer_env=syncer_env))
        record = _Driver(cluster, spawner, cfg, faults, metrics, note, emu).run(options)
    (rdir / "chaos_record.json").write_text(record.to_json())
    return record
