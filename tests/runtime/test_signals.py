"""SIGTERM to `wan-diloco launch` stops every child process and exits 130 (a stop, resumable) with the reason."""
import json
import os
import signal
import subprocess
import sys
import time

from .conftest import micro_config


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


def test_sigterm_stops_every_child(tmp_path):
    path = micro_config(tmp_path, learners=2, steps=100000, min_step_s=0.05)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "wan_diloco.cli", "launch", "--config", str(path),
                             "--run-dir", str(run_dir), "--quiet"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            events = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
            pids = {e["pid"] for e in events if "pid" in e}
            if sum(e.get("event") == "step" for e in events) >= 2 and len(pids) == 3:
                break
            time.sleep(0.2)
        assert len(pids) == 3, "syncer and learners did not start"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)  # it waits for a last snapshot first
        assert proc.returncode == 130
        assert b"stopped by SIGTERM" in err
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in pids:  # only our own children, should the launcher have failed to stop them
            if alive(p):
                os.killpg(p, signal.SIGKILL)
