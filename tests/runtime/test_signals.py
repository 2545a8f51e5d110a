"""SIGTERM to `wan-diloco launch` stops every child process and exits 130 (a stop, resumable) with the reason."""
import signal
import subprocess

from .conftest import micro_config
from .helpers import Launched, alive, wait_for


def test_sigterm_stops_every_child(tmp_path):
    path = micro_config(tmp_path, learners=2, steps=100000, min_step_s=0.05)
    run_dir = tmp_path / "run"
    with Launched(["--config", str(path), "--run-dir", str(run_dir)], run_dir, stderr=subprocess.PIPE,
                  stdout=subprocess.DEVNULL) as launched:
        launched.wait("the syncer and learners to start", lambda events: sum(
            e.get("event") == "step" for e in events) >= 2 and len(launched.pids) == 3, timeout_s=90)
        launched.proc.send_signal(signal.SIGTERM)
        _, err = launched.proc.communicate(timeout=90)  # it waits for a last snapshot first
        assert launched.proc.returncode == 130
        assert b"stopped by SIGTERM" in err
        wait_for("every child to exit", lambda: not any(alive(p) for p in launched.pids), timeout_s=10)
