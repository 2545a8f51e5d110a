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

from wan_diloco.spec import TOKEN_ENV, RunSpec

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


class Cluster:
    """Children of one run; ``events`` yields (child name, event dict) from all of them."""

    def __init__(self, cfg: RunSpec, config_path: Path, run_dir: Path, token: str | None = None,
                 env: dict | None = None):
        self.cfg, self.config_path, self.run_dir = cfg, Path(config_path), Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token = token or cfg.run.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        self.env = child_env(self.token, env)
        self.children: dict[str, Child] = {}
        self.events: queue.Queue = queue.Queue()
        self.syncer_port: int | None = None
        self.status_port: int | None = None

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def _spawn(self, name: str, args: list[str]) -> Child:
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "wan_diloco.cli", *args], stdout=subprocess.PIPE, stderr=log,
                env=self.env, start_new_session=True,  # own process group: Ctrl-C reaches only the launcher
            )
        finally:
            log.close()
        child = self.children[name] = Child(name, proc, log_path)
        child.reader = threading.Thread(target=self._read, args=(child,), daemon=True)
        child.reader.start()
        return child

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

    def start_syncer(self, timeout_s: float = 180.0) -> Child:
        child = self._spawn("syncer", ["syncer", "--config", str(self.config_path)])
        deadline = time.monotonic() + timeout_s
        while self.syncer_port is None:
            if child.exit_code is not None:
                raise RuntimeError(f"syncer exited with code {child.exit_code} before listening; see {child.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"syncer did not start listening within {timeout_s:.0f} s; see {child.log_path}")
            for e in list(child.events):
                if e.get("event") == "listening":
                    self.syncer_port, self.status_port = e["port"], e.get("status_port")
            time.sleep(0.05)
        return child

    @property
    def syncer_target(self) -> str:
        host = self.cfg.run.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        return f"{host}:{self.syncer_port}"

    def start_learner(self, m: int) -> Child:
        name = f"learner-{m}"
        old = self.children.get(name)
        if old is not None and old.exit_code is None:
            raise RuntimeError(f"{name} is still running")
        return self._spawn(name, ["learner", "--config", str(self.config_path), "--id", str(m),
                                  "--syncer", self.syncer_target])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children[name]
        if child.exit_code is None:
            try:
                os.killpg(child.proc.pid, sig)
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
