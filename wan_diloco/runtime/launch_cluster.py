"""Local processes of a run: a syncer and M learners, each in its own process group.

``Cluster`` starts them with this Python, reads their JSON lines from stdout
(stderr goes to a log file per process), and stops them all: SIGTERM to each
process group, SIGKILL after a timeout. It is a context manager so children
never outlive it, also when the caller fails.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from wan_diloco.runtime.launch_names import (is_learner_name, is_syncer, learner_of, learner_process, process_name,
                                             shard_name)
from wan_diloco.spec import TOKEN_ENV, RunSpec
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

    def code_after_output(self) -> int | None:
        """The exit code of a child whose output has ended: it closes stdout as it exits, so the code
        is a moment away (None if it somehow lives on without stdout)."""
        try:
            return self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return self.proc.poll()


PARENT_ENV = "WAN_DILOCO_PARENT_PID"


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
        self.token = token or cfg.given_token() or secrets.token_urlsafe(24)
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
        if is_syncer(name) or not is_learner_name(name):
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
