"""Local processes of a run: a syncer and M learners, each in its own process group.

``Cluster`` starts them with this Python, reads their JSON lines from stdout
(stderr goes to a log file per process), and stops them all: SIGTERM to each
process group, SIGKILL after a timeout. It is a context manager so children
never outlive it, also when the caller fails. ``launch`` runs a whole run with
it: every event goes to ``RUN_DIR/metrics.jsonl``, folded into a ``RunState``;
Ctrl-C or SIGTERM stops every child; a run that cannot continue (the syncer
died, or every learner did) ends with the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from wan_diloco import spec as spec_lib
from wan_diloco.checkpoint import CheckpointError, describe_os_error
from wan_diloco.regions import Emulator, EmulatorError
from wan_diloco.spec import TOKEN_ENV, RunSpec
from wan_diloco.transport.dev_certs import make_dev_certs
from wan_diloco.transport.security import derive_token

THREAD_ENV = {
    # 1 + M JAX processes share the machine: one compute thread each instead of one per core each.
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def child_env(token: str, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k, v in THREAD_ENV.items():
        env[k] = f"{env[k]} {v}" if k == "XLA_FLAGS" and env.get(k) and v not in env[k] else env.get(k, v)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    env[TOKEN_ENV] = token
    env.update(extra or {})
    return env


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    events: list = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()


PARENT_ENV = "WAN_DILOCO_PARENT_PID"
# learner-N, and learner-N.pI for process I > 0 of a learner of several processes (learner.hosts).
_LEARNER_NAME = re.compile(r"learner-(0|[1-9][0-9]{0,8})(?:\.p([1-9][0-9]{0,4}))?")


def die_with_parent() -> None:
    """In a child of ``Cluster`` (``PARENT_ENV`` names the launcher): ask the kernel for SIGTERM, the
    child's clean stop, when the launcher dies, also by SIGKILL or the OOM killer; otherwise the
    learners would train on until their own timeouts noticed. Set by the child at start rather than
    between fork and exec: a launcher with threads (stdout readers, JAX) must not run Python in a
    forked child. It survives an ``ip netns exec`` wrapper, which execs in place. Linux only."""
    parent = os.environ.get(PARENT_ENV, "")
    if not (parent.isdigit() and sys.platform.startswith("linux")):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # the launcher died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


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


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def last_lines(path: Path, n: int = 1) -> list[str]:
    """The last ``n`` non-empty lines of a log file (what a process said before it died)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []
    return [ln.rstrip()[:300] for ln in lines[-n:]]


def last_line(path: Path) -> str:
    return (last_lines(path) or [""])[0].strip()


def died(child: "Child", lines: int = 5) -> str:
    """``NAME exited with code C``, then the last lines of its log, indented (the launcher's account of a
    dead process: the reason is usually there, not in the exit code)."""
    tail = last_lines(child.log_path, lines)
    said = "".join(f"\n    {ln}" for ln in tail) if tail else " (its log is empty)"
    return f"{child.name} exited with code {child.exit_code}; the end of {child.log_path}:{said}"


class Cluster:
    """Children of one run; ``events`` yields (child name, event dict) from all of them."""

    def __init__(self, cfg: RunSpec, config_path: Path, run_dir: Path, token: str | None = None,
                 env: dict | None = None, wrap: Callable[[str], list[str]] | None = None):
        """``wrap(name)`` is an argv prefix for child ``name`` (e.g. ``ip netns exec NS``)."""
        self.cfg, self.config_path, self.run_dir = cfg, Path(config_path), Path(run_dir)
        self.wrap = wrap or (lambda name: [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token = token or cfg.run.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        self.env = child_env(self.token, env)
        self.children: dict[str, Child] = {}
        # Bounded: a launcher that stops reading holds its children back (their stdout fills) instead
        # of growing without end.
        self.events: queue.Queue = queue.Queue(maxsize=100_000)
        self.syncer_port: int | None = None  # shard 0's (the only shard of an unsharded run)
        self.status_port: int | None = None
        self.shard_ports: dict[int, int] = {}  # each syncer shard's gRPC and status ports, kept over restarts
        self.shard_status_ports: dict[int, int | None] = {}

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def _spawn(self, name: str, args: list[str]) -> Child:
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                [*self.wrap(name), sys.executable, "-m", "wan_diloco.cli", *args], stdout=subprocess.PIPE, stderr=log,
                # Own process group: Ctrl-C reaches only the launcher. The child stops when we die
                # (die_with_parent), also by SIGKILL.
                env=self._env_of(name), start_new_session=True,
            )
        finally:
            log.close()
        child = self.children[name] = Child(name, proc, log_path)
        child.reader = threading.Thread(target=self._read, args=(child,), daemon=True)
        child.reader.start()
        return child

    def _env_of(self, name: str) -> dict:
        env = {**self.env, **self._own_token(name), PARENT_ENV: str(os.getpid())}
        run = self.cfg.run
        if is_syncer(name) or run.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"  # the syncer merges on the CPU; it needs no accelerator of its own
        elif run.platform == "gpu":
            env["JAX_PLATFORMS"] = "cuda"
            if run.devices_per_learner:
                # A learner of P processes splits its GPUs: process i gets the i-th block of N/P.
                (m, i), hosts = learner_process(name), self.cfg.learner.hosts
                n = run.devices_per_learner // hosts
                first = m * run.devices_per_learner + i * n
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(first, first + n))
        else:
            env.pop("JAX_PLATFORMS", None)
        return env

    def _own_token(self, name: str) -> dict:
        """A learner (each of its processes) gets only its own token, on every run: it can speak only as
        itself whatever the run file says; the syncer keeps the run's."""
        if is_syncer(name) or not _LEARNER_NAME.fullmatch(name):
            return {}  # the syncer, or a helper process of the caller's own (not a learner of the run)
        return {TOKEN_ENV: derive_token(self.token, f"learner-{learner_of(name)}")}  # core.learner_node

    def _read(self, child: Child) -> None:
        for raw in child.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict):
                child.events.append(event)
                self.events.put((child.name, event))
        self.events.put((child.name, {"event": "exit"}))

    def start_syncers(self, timeout_s: float = 180.0, resume: bool = False) -> None:
        """Start every syncer shard, shard 0 last (its /status gathers the others')."""
        for shard in reversed(range(self.cfg.syncer.shards)):
            self.start_syncer(timeout_s, resume, shard)

    def start_syncer(self, timeout_s: float = 180.0, resume: bool = False, shard: int = 0) -> Child:
        """Start syncer shard ``shard`` and wait until it listens. A restart keeps the port, so that
        running learners find it again; with ``resume`` it takes up its newest complete snapshot."""
        name, S = shard_name(shard), self.cfg.syncer.shards
        old = self.children.get(name)
        if old is not None and old.exit_code is None:
            raise RuntimeError(f"{name} is still running")
        args = ["syncer", "--config", str(self.config_path)]
        if S > 1:
            args += ["--shard", str(shard)]
            if shard == 0 and self.cfg.run.status_port >= 0 and all(self.shard_status_ports.get(s)
                                                                   for s in range(1, S)):
                args += ["--shard-status", ",".join(self._status_url(s) for s in range(1, S))]
        port = self.shard_ports.get(shard, 0 if shard else None)  # shards 1.. on free ports of their own
        if port is not None:
            args += ["--port", str(port)]
        child = self._spawn(name, args + (["--resume"] if resume else []))
        deadline = time.monotonic() + timeout_s
        while True:
            if child.exit_code is not None:
                raise RuntimeError(f"{name} exited with code {child.exit_code} before listening: "
                                   f"{last_line(child.log_path)} (see {child.log_path})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start listening within {timeout_s:.0f} s; see {child.log_path}")
            for e in list(child.events):
                if e.get("event") == "listening":
                    self.shard_ports[shard], self.shard_status_ports[shard] = e["port"], e.get("status_port")
                    if shard == 0:
                        self.syncer_port, self.status_port = e["port"], e.get("status_port")
                    return child
            time.sleep(0.05)

    def _host(self) -> str:
        host = self.cfg.run.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)

    def _status_url(self, shard: int) -> str:
        scheme = "https" if self.cfg.transport.tls is not None else "http"
        return f"{scheme}://{self._host()}:{self.shard_status_ports[shard]}"

    @property
    def syncer_target(self) -> str:
        """What a learner's --syncer gets: every shard's address, in shard order."""
        return ",".join(f"{self._host()}:{self.shard_ports[s]}" for s in range(self.cfg.syncer.shards))

    def start_learner(self, m: int, resume: bool = False) -> Child:
        """Start learner m; with ``learner.hosts`` = P > 1 as P processes meeting at a coordinator port of
        their own on 127.0.0.1: ``learner-m`` (the leader: the learner as the run sees it, returned) and
        ``learner-m.p1`` .. ``learner-m.p{P-1}``."""
        names = [process_name(m, i) for i in range(self.cfg.learner.hosts)]
        for name in names:
            old = self.children.get(name)
            if old is not None and old.exit_code is None:
                raise RuntimeError(f"{name} is still running")
        args = ["learner", "--config", str(self.config_path), "--id", str(m),
                "--syncer", self.syncer_target] + (["--resume"] if resume else [])
        if len(names) == 1:
            return self._spawn(names[0], args)
        coordinator = f"127.0.0.1:{free_port()}"
        leader = self._spawn(names[0], args + ["--process-id", "0", "--num-processes", str(len(names)),
                                               "--coordinator", coordinator])
        for i, name in enumerate(names[1:], 1):
            self._spawn(name, args + ["--process-id", str(i), "--num-processes", str(len(names)),
                                      "--coordinator", coordinator])
        return leader

    def processes_of(self, name: str) -> list[Child]:
        """A learner's processes that exist (its leader first), or just ``name``'s child (a syncer shard)."""
        if is_syncer(name) or learner_process(name)[1]:
            return [self.children[name]]
        m = learner_of(name)
        return [c for i in range(self.cfg.learner.hosts) if (c := self.children.get(process_name(m, i)))]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal ``name``; a learner's leader together with its followers (they ignore SIGTERM and
        follow the leader's stop; SIGKILL would leave them to notice the broken job themselves)."""
        children = self.processes_of(name)
        if not children:
            raise KeyError(name)
        for child in children[:1] if sig != signal.SIGKILL else children:
            if child.exit_code is None:
                try:
                    os.killpg(child.proc.pid, sig)
                except ProcessLookupError:
                    pass
        for child in children:
            try:
                child.proc.wait(10)
            except subprocess.TimeoutExpired:
                if child is children[0]:
                    raise
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait(10)

    def stop_all(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after ``timeout_s``."""
        live = [c for c in self.children.values() if c.exit_code is None]
        for c in live:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children.values():
            if c.exit_code is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait(10)
        for c in self.children.values():
            if c.reader is not None:
                c.reader.join(5)
            if c.proc.stdout is not None and (c.reader is None or not c.reader.is_alive()):
                c.proc.stdout.close()


class RunFailed(Exception):
    """The run cannot continue; the text says why."""


class RunStopped(Exception):
    """The operator stopped the run (SIGINT, SIGTERM): not a failure, it can be resumed."""


STOP_SNAPSHOT_S = 60.0  # a stopped run waits this long for its final snapshot (a second Ctrl-C: not at all)
STOPPED_EXIT = 130  # launch stopped by SIGINT or SIGTERM: a stop the operator asked for, resumable


def stop_snapshot(cluster: "Cluster", take: Callable[[str, dict], None], stop: dict,
                  wait_s: float = STOP_SNAPSHOT_S) -> int | None:
    """Ask the syncer for a snapshot now (SIGUSR1, to every shard) and wait at most ``wait_s`` for shard 0 to
    report it complete, feeding every event meanwhile to ``take``; its id, or None (no syncer, no
    checkpoint.dir, too slow, a second signal)."""
    syncer = cluster.children.get("syncer")
    if syncer is None or syncer.exit_code is not None or not cluster.cfg.checkpoint.dir:
        return None
    for name, c in cluster.children.items():
        if is_syncer(name) and c.exit_code is None:
            try:
                os.kill(c.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    asked, deadline, cut = stop["count"], time.monotonic() + wait_s, None
    while time.monotonic() < deadline and stop["count"] == asked and syncer.exit_code is None:
        try:
            name, e = cluster.events.get(timeout=0.25)
        except queue.Empty:
            continue
        take(name, e)
        if name != "syncer":
            continue
        if e.get("event") == "snapshot_requested":
            if e.get("snapshot") is None:
                return None  # nothing to cut (the final sync began): no use waiting
            cut = int(e["snapshot"])
        elif e.get("event") == "snapshot" and cut is not None and int(e["snapshot"]) >= cut:
            return int(e["snapshot"])
    return None


class RunState:
    """Latest state of every process of a run, folded from their events."""

    def __init__(self, cfg: RunSpec):
        self.cfg = cfg
        self.learners: dict[int, dict] = {m: {"region": cfg.region(m), "status": "starting", "tau": cfg.learner.tau}
                                          for m in range(cfg.run.learners)}
        self.syncer: dict = {}
        self.syncer_final: dict | None = None
        self.shard_finals: dict[int, dict] = {}  # syncer shards 1..: their final reports
        self.shards: dict[int, dict] = {}  # syncer shards 1..: what they last reported (as ``syncer`` for shard 0)
        self.finals: dict[int, dict] = {}
        self.starts: dict[int, dict] = {}
        self.evals: list[dict] = []  # the global model's eval points (run.eval_every_steps), in step order
        self.losses: dict[int, list[tuple[int, float]]] = {m: [] for m in range(cfg.run.learners)}
        self.tokens: dict[int, list[tuple[float, int]]] = {m: [] for m in range(cfg.run.learners)}  # (t, tokens)
        self.barrier: dict = {}  # the start barrier as last heard: need, joined, waiting_for, started

    def fold(self, name: str, e: dict) -> None:
        kind = e.get("event")
        if is_syncer(name):
            if name != "syncer":
                if kind == "final":
                    self.shard_finals[shard_of(name)] = e
                if kind in ("progress", "final", "listening"):
                    self.shards.setdefault(shard_of(name), {}).update(e)
                return
            if kind == "final":
                self.syncer_final = e
            if kind in ("progress", "final", "listening"):
                self.syncer.update(e)
            if kind == "barrier":
                self.barrier = {k: e.get(k) for k in ("need", "joined", "waiting_for", "started")}
            return
        m, process = learner_process(name)
        if process:  # a follower of a learner of several processes: the leader speaks for the learner
            return
        row = self.learners[m]
        if kind == "barrier":
            if not self.barrier.get("started"):
                self.barrier = {k: e.get(k) for k in ("need", "joined", "waiting_for", "started")}
            row["status"] = "starting" if e.get("started") else (
                "waiting for " + ", ".join(f"learner-{w}" for w in e.get("waiting_for") or ()) or "waiting to start")
        elif kind == "start":
            self.starts.setdefault(m, e)
            row["status"] = "training"
        elif kind == "step":
            row.update(e)
            self.losses[m].append((e["step"], e["loss"]))
            if "t" in e:
                self.tokens[m].append((e["t"], e["tokens"]))
        elif kind == "eval":
            self.evals.append({k: e[k] for k in ("step", "eval_loss", "tokens")})
            self.evals.sort(key=lambda x: x["step"])
        elif kind == "finishing":
            row["status"] = "final sync"
        elif kind == "link":
            row["link"] = {k: e[k] for k in ("rtt_ms", "rate_gbit_s")}
        elif kind == "replan":
            row["tau"] = e["tau_new"]
        elif kind == "final":
            self.finals[m] = e
            row.update(status="done", step=e["steps"], loss=e["last_loss"], tokens=e["tokens"],
                       bytes_sent=e["bytes_sent"])
        elif kind == "exit" and row.get("status") != "done":
            row["status"] = "exited"


def trained_finals(mon: RunState) -> dict[int, dict]:
    """The final reports of learners that trained (tokens > 0): one "recovered" at the end with nothing
    trained did not do any of the run's work and is no finished learner."""
    return {m: f for m, f in mon.finals.items() if f.get("tokens", 0) > 0}


def first_starts(mon: RunState) -> dict[int, dict]:
    """The start reports of the run's first start (the lowest step any learner started at): a learner that
    joined later evaluated a model others had trained already, which is no initial loss."""
    if not mon.starts:
        return {}
    first = min(e.get("step", 0) for e in mon.starts.values())
    return {m: e for m, e in mon.starts.items() if e.get("step", 0) == first}


def summarize(mon: RunState, wall_s: float) -> dict:
    """The run's figures once it is over (what `launch` prints and writes as JSON)."""
    cfg, finals = mon.cfg, list(trained_finals(mon).values())
    starts = list(first_starts(mon).values())
    sf = joined_final(mon.syncer_final or {}, mon.shard_finals)
    params = int(mon.syncer.get("params", 0))
    M = cfg.run.learners
    dp_bytes = cfg.run.steps * 2 * (M - 1) / M * params * 4 * M
    sent = int(sf.get("bytes_in", 0)) + int(sf.get("bytes_out", 0))
    raw = sum(f["raw_bytes"] for f in finals)
    payload = sum(f["payload_bytes"] for f in finals)
    digests = sf.get("digests")
    lags = [f["merge_lag_steps"] for f in finals if f.get("merge_lag_steps") is not None]
    return {
        "learners_finished": len(finals), "learners": M,
        # The syncer's view: also learners restarted by hand outside this launcher, whose events it never saw.
        "final_learners": sf.get("final_learners", []),
        "initial_eval_loss": sum(s["eval_loss"] for s in starts) / max(1, len(starts)),
        "final_eval_loss": sum(f["final_eval_loss"] for f in finals) / max(1, len(finals)),
        "tokens": sum(f["tokens"] for f in finals), "global_steps": sf.get("global_step", 0),
        "goodput": sum(f["compute_s"] for f in finals) / max(1e-9, sum(f["train_s"] for f in finals)),
        "fragment_syncs": sf.get("fragment_syncs", []), "mean_quorum": sf.get("mean_quorum", 0.0),
        "late_carried": sf.get("late_carried", 0),
        "bytes_sent": sent, "dp_bytes": dp_bytes, "compression_ratio": raw / payload if payload else 1.0,
        "bit_identical": bool(digests) and all(f["digests"] == digests for f in finals),
        "params": params, "wall_s": wall_s,
        # Steps a learner trained between sending a fragment and merging the answer (mean over learners).
        "merge_lag_steps": sum(lags) / len(lags) if lags else None,
        "run_id": sf.get("run_id"), "params_path": sf.get("params_path"),
        "snapshots": sf.get("snapshots_complete", 0), "syncer_epoch": sf.get("epoch"),
        "eval_curve": mon.evals,
        # Each learner's own work: a learner that trained nothing shows 0 here, whatever its final report says.
        "per_learner": {str(m): {"steps": int(mon.finals.get(m, row).get("steps", row.get("step", 0)) or 0),
                                 "tokens": int(mon.finals.get(m, row).get("tokens", 0) or 0),
                                 "finished": m in trained_finals(mon), "status": row.get("status")}
                        for m, row in mon.learners.items()},
        # How far the run got: the syncer's step, or a learner's that finished its final sync (its last
        # steps reach the syncer only in the final uploads).
        "budget_steps": cfg.run.steps,
        "resumed": mon.syncer.get("resumed"),
        "steps_reached": max([int(sf.get("global_step", 0))] + [int(f["steps"]) for f in finals]),
    }


def verdict(summary: dict) -> list[str]:
    """What makes a run that ended not a success, one line each (empty: it is one): the global step budget not
    reached, no learner that trained, learners whose final fragments differ from the syncer's."""
    problems = []
    budget, reached = summary.get("budget_steps", 0), summary.get("steps_reached", 0)
    if reached < budget:
        problems.append(f"the run stopped at global step {reached} of its {budget}-step budget")
    if not summary.get("learners_finished"):
        problems.append("no learner trained to the end of the run")
    elif not summary.get("bit_identical"):
        problems.append("the learners' final fragments differ from the syncer's (final digests: see the learners' "
                        "final events in metrics.jsonl)")
    return problems


def joined_final(first: dict, others: dict[int, dict]) -> dict:
    """Shard 0's final report with the other shards' fragments and byte counts folded in."""
    if not others or not first:
        return first
    out = dict(first)
    digests, syncs = list(first.get("digests") or []), list(first.get("fragment_syncs") or [])
    for e in others.values():
        for p, d in enumerate(e.get("digests") or []):
            if d is not None and p < len(digests):
                digests[p] = d
        for p, n in enumerate(e.get("fragment_syncs") or []):
            if p < len(syncs):
                syncs[p] += n  # a shard counts only its own fragments' merges
        for key in ("bytes_in", "bytes_out"):
            out[key] = out.get(key, 0) + e.get(key, 0)
    out["digests"], out["fragment_syncs"] = digests, syncs
    return out


def join_shard_params(cfg: RunSpec, shards: int) -> Path | None:
    """The shards' final parameters as one file (``checkpoint.dir/params.safetensors``); CheckpointError
    naming a shard's file that is missing, OSError if the joined file cannot be written."""
    from wan_diloco.checkpoint.params import join_params

    root = Path(cfg.checkpoint.dir)
    parts = [root / f"params.shard-{s}.safetensors" for s in range(shards)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]} is missing")
    return join_params(parts, root / "params.safetensors")


def run_spec(cfg: RunSpec, rdir: Path) -> RunSpec:
    """What the processes of a launched run read (``RUN_DIR/config.toml``): a run id, snapshots under
    the run folder (``checkpoints``, or a relative ``checkpoint.dir`` taken relative to it), a start barrier of every
    learner (unless ``run.min_learners_to_start`` says otherwise), and no token (children
    get it in their environment; a file would leak it)."""
    changes: dict = {"run": {"token": "", "run_id": cfg.run.run_id or f"{rdir.name}-{secrets.token_hex(4)}",
                             # the start barrier: every learner of the run unless the config says how many
                             "min_learners_to_start": cfg.run.min_learners_to_start or cfg.run.learners}}
    if not Path(cfg.checkpoint.dir or "checkpoints").is_absolute():
        changes["checkpoint"] = {"dir": str((rdir / (cfg.checkpoint.dir or "checkpoints")).resolve())}
    return cfg.with_changes(**changes)


def write_config(path: Path, cfg: RunSpec) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(spec_lib.dumps(cfg))


def launch(cfg: RunSpec, config_text: str, run_dir: str | None = None,
           watch: Callable[[RunState], None] | None = None, emulate: bool | Emulator = False,
           emulator_prefix: str = "wdl", resume: bool = False) -> tuple[int, dict]:
    """Run everything to the end; returns (exit code, summary). ``watch(state)`` sees every update.

    With ``emulate`` the syncer and every learner run in their region's network
    namespace of an emulated WAN built from ``[regions]`` (``regions.Emulator``,
    needs root), over TLS with a throwaway CA made for the run (cleartext is
    refused off loopback); the resolved config is ``RUN_DIR/config.toml``. An
    ``Emulator`` already entered (a benchmark that changes links during the
    run) is used as it is and left up.

    The summary of a failed run has ``error`` (why); ``failed_learners`` names learners
    that did not finish a run that otherwise did.

    With ``resume`` (``run_dir`` required, ``cfg`` read from its config.toml) every process starts
    from the newest complete snapshot under the run's checkpoint.dir."""
    from wan_diloco.assemble import preflight  # JAX and the model: not for `wan-diloco --help`

    preflight(cfg)  # a missing corpus or too many fragments: one ConfigError, before any process starts
    if cfg.run.tensorboard:
        from wan_diloco.runtime.tb_log import writer_class

        writer_class()  # ConfigError now, not after the processes started
    rdir = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        cfg = cfg if resume else run_spec(cfg, rdir)
        if not emulate and not resume:
            write_config(rdir / "config.toml", cfg)
    except OSError as e:  # a full or read-only disk: the launcher's own files, one line and no traceback
        return 1, {"error": f"cannot write the run folder {rdir}: {describe_os_error(e)}", "run_dir": str(rdir)}
    if not emulate:
        return _run(cfg, rdir, watch, resume=resume)
    try:
        with contextlib.ExitStack() as stack:
            emu = emulate if isinstance(emulate, Emulator) else stack.enter_context(
                Emulator(cfg.regions, prefix=emulator_prefix))
            ecfg = emulated_spec(cfg, emu, rdir / "tls")
            write_config(rdir / "config.toml", ecfg)
            info = {"backend": emu.backend, "namespaces": emu.describe()}
            code, summary = _run(ecfg, rdir, watch, wrap=lambda name: emu.netns_argv(_region_of(ecfg, name)),
                                 resume=resume)
            return code, {**summary, "emulator": info}
    except EmulatorError as e:
        return 1, {"error": f"emulated WAN: {e}", "run_dir": str(rdir)}


def _region_of(cfg: RunSpec, name: str) -> str:
    return cfg.regions.syncer_region if is_syncer(name) else cfg.region(learner_of(name))


def emulated_spec(cfg: RunSpec, emu: Emulator, tls_dir: Path) -> RunSpec:
    """``cfg`` with the syncer on its region's emulated address and TLS from a CA made for this run."""
    host = emu.address_of(cfg.regions.syncer_region)
    certs = make_dev_certs(tls_dir, hosts=(host,))
    # One file for every process: the syncer reads cert and key, learners the CA.
    tls = {"cert_file": certs["server"].cert_file, "key_file": certs["server"].key_file,
           "ca_file": certs["client"].ca_file}
    return cfg.with_changes(run={"host": host}, transport={"tls": tls})


def _run(cfg: RunSpec, rdir: Path, watch: Callable[[RunState], None] | None,
         wrap: Callable[[str], list[str]] | None = None, resume: bool = False) -> tuple[int, dict]:
    mon, t0 = RunState(cfg), time.monotonic()
    stop = {"sig": 0, "count": 0}

    def on_signal(signum, _frame):
        stop["sig"] = signum
        stop["count"] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tb = None
    if cfg.run.tensorboard:
        from wan_diloco.runtime.tb_log import TensorBoardLog

        tb = TensorBoardLog(rdir / "tensorboard")
    try:
        with Cluster(cfg, rdir / "config.toml", rdir, wrap=wrap) as cluster, \
                open(rdir / "metrics.jsonl", "a" if resume else "w") as mf:
            try:
                cluster.start_syncers(resume=resume)
            except RuntimeError as e:
                raise RunFailed(str(e)) from None
            def take(name: str, e: dict) -> None:
                mf.write(json.dumps({"source": name, **e}) + "\n")
                mon.fold(name, e)
                if tb is not None:
                    tb.write(name, e)
                if watch is not None:
                    watch(mon)

            for m in range(cfg.run.learners):
                if stop["sig"]:
                    break
                cluster.start_learner(m, resume=resume)
            while True:
                if stop["sig"]:
                    # A stop, not a failure: a last snapshot when the syncer can cut one, then every child stops.
                    snap = stop_snapshot(cluster, take, stop)
                    raise RunStopped(f"stopped by {signal.Signals(stop['sig']).name}" +
                                     (f"; snapshot {snap} taken" if snap is not None else
                                      "; no final snapshot (the newest earlier one is resumed)"))
                try:
                    take(*cluster.events.get(timeout=0.25))
                except queue.Empty:
                    pass
                syncers = [c for n, c in cluster.children.items() if is_syncer(n)]
                learners = [c for n, c in cluster.children.items() if not is_syncer(n) and not learner_process(n)[1]]
                finished = {0: mon.syncer_final, **mon.shard_finals}
                for c in syncers:
                    lost = (finished.get(shard_of(c.name)) or {}).get("params_error")
                    if c.exit_code is not None and lost:  # the run's result: not a success, and not a crash
                        raise RunFailed(f"final parameters not written: {lost}")
                    if c.exit_code is not None and (c.exit_code != 0 or finished.get(shard_of(c.name)) is None):
                        raise RunFailed(f"the syncer died: {died(c)}" if c.name == "syncer" else
                                        f"syncer shard {shard_of(c.name)} died: {died(c)}")
                if all(c.exit_code is not None for c in syncers):
                    # Followers too: they exit once their leader told them (their logs end complete).
                    if all(c.exit_code is not None for n, c in cluster.children.items() if not is_syncer(n)) \
                            and cluster.events.empty():
                        break
                elif all(c.exit_code is not None and c.exit_code != 0 for c in learners):
                    raise RunFailed("every learner died:\n" + "\n".join(died(c, lines=3) for c in learners))
        failed = {c.name: (c.exit_code, str(c.log_path)) for n, c in cluster.children.items()
                  if not is_syncer(n) and not learner_process(n)[1] and c.exit_code != 0}
        summary = {**summarize(mon, time.monotonic() - t0), "run_dir": str(rdir), "failed_learners": failed,
                   "tensorboard": str(rdir / "tensorboard") if tb is not None else None}
        if cfg.syncer.shards > 1 and cfg.checkpoint.dir:
            try:
                summary["params_path"] = str(join_shard_params(cfg, cfg.syncer.shards))
            except (OSError, CheckpointError) as e:  # the run's result is not there: not a success
                why = describe_os_error(e) if isinstance(e, OSError) else str(e)
                where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
                return 1, {**summary, "params_path": None,
                           "error": f"final parameters not written: joining the shards' files: {where}{why}"}
        try:
            from wan_diloco.runtime.run_plot import plot_run

            # Never an untrained copy's eval: a late joiner's start, a learner that finished with nothing trained.
            plot_run(mon.losses, mon.evals, [s["eval_loss"] for s in first_starts(mon).values()],
                     [(f["steps"], f["final_eval_loss"]) for f in trained_finals(mon).values()], rdir / "loss.png",
                     title=f"{cfg.run.learners} learners, {cfg.run.steps} steps ({cfg.preset})", tokens=mon.tokens)
            summary["loss_png"] = str(rdir / "loss.png")
        except (OSError, ValueError) as e:  # a picture is not worth failing a finished run for
            summary["loss_png"] = None
            print(f"wan-diloco: could not draw the loss curve: {e}", file=sys.stderr)
        problems = verdict(summary)
        if problems:  # it ended, but not as a success: exit status and summary say so
            return 1, {**summary, "error": "; ".join(problems)}
        return 0, summary
    except RunStopped as e:
        return STOPPED_EXIT, {"stopped": str(e), "run_dir": str(rdir), "resume": f"wan-diloco launch --resume {rdir}"}
    except RunFailed as e:
        return (STOPPED_EXIT if stop["sig"] else 1), {"error": str(e), "run_dir": str(rdir)}
    except OSError as e:  # the launcher's own files (logs, metrics.jsonl) on a full or read-only disk
        where = e.filename or rdir
        return 1, {"error": f"the launcher failed on {where}: {describe_os_error(e)}; every process was stopped",
                   "run_dir": str(rdir)}
    finally:
        if tb is not None:
            tb.close()
        for s, h in old.items():
            signal.signal(s, h)
