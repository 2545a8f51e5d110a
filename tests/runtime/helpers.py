"""What runtime tests share: a syncer's /status, waiting on a condition, and `wan-diloco launch` run as a
child that is stopped with everything it started, also when the test fails."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def status(cluster) -> dict:
    """Shard 0's /status (the whole run's) of a ``launch.Cluster``."""
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.status_port}/status",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_for(what, predicate, timeout_s=60.0, every_s=0.1):
    """The first truthy value of ``predicate()``; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


LAUNCH = [sys.executable, "-m", "wan_diloco.cli", "launch", "--quiet"]


def launch_env() -> dict:
    """The environment a `wan-diloco` child needs to import this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


class Launched:
    """`wan-diloco launch ARGS` in a session of its own (``popen``: its stdout/stderr). On leaving the
    ``with``, the launcher and every process it started that is still alive are killed."""

    def __init__(self, args: list[str], run_dir: Path, **popen):
        self.run_dir = Path(run_dir)
        self.pids: set[int] = set()  # the processes it started, as their events name them
        self.proc = subprocess.Popen([*LAUNCH, *args], env=launch_env(), start_new_session=True, **popen)

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for p in self.pids:  # only our own children, should the launcher have failed to stop them
            if alive(p):
                os.killpg(p, signal.SIGKILL)

    def events(self) -> list[dict]:
        metrics = self.run_dir / "metrics.jsonl"
        events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        self.pids |= {e["pid"] for e in events if "pid" in e}
        return events

    def wait(self, what: str, ready, timeout_s: float) -> list[dict]:
        """The run's events once ``ready(events)`` holds; AssertionError naming ``what`` after ``timeout_s``."""
        return wait_for(what, lambda: (events := self.events()) and ready(events) and events, timeout_s, 0.2)
