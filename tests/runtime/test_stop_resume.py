"""Ctrl-C of `wan-diloco launch` is a stop, not a failure (#23, case 9): it takes a last snapshot, stops
every child, prints the command that goes on and exits 130; that command then finishes the run. A learner
whose part of that snapshot is damaged takes its state from a peer (case 12), not a fresh one."""
import json
import signal
import subprocess

import pytest

from wan_diloco.checkpoint import SnapshotStore

from .conftest import micro_config
from .helpers import LAUNCH, Launched, alive, launch_env


@pytest.mark.slow  # two whole launches (~170 s on the shared CI box); test_signals covers the stop by default
def test_a_launch_stopped_by_sigint_soon_after_its_start_can_be_resumed(tmp_path):
    # No periodic snapshots: what the resume takes up is the one the stop asked for.
    extra = "\n[checkpoint]\nevery_merges = 0\n"
    # Enough steps left after the stop that learner 1, recovering from its peer for a second or two, still
    # trains in the resumed run (with 64 steps learner 0 finished them alone meanwhile: 1 of 2 trained).
    path = micro_config(tmp_path, learners=2, steps=200, min_step_s=0.05, extra=extra)
    run_dir = tmp_path / "run"
    with Launched(["--config", str(path), "--run-dir", str(run_dir)], run_dir, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True) as launched:
        launched.wait("the learners to train", lambda events: {
            e["source"] for e in events if e.get("event") == "step" and e["step"] >= 8} == {"learner-0", "learner-1"},
            timeout_s=180)
        proc, pids = launched.proc, launched.pids
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert f"wan-diloco launch --resume {run_dir}" in out.splitlines()
        assert "run failed" not in err and "stopped by SIGINT; snapshot" in err
        assert not any(alive(p) for p in pids)
        store = SnapshotStore(run_dir / "checkpoints")
        assert store.ids(), "the stop took no snapshot"
        part = store.part(store.ids()[-1], "learner-1")
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped byte: the part fails its digest
        part.write_bytes(bytes(data))
        resumed = subprocess.run([*LAUNCH, "--resume", str(run_dir), "--json", str(tmp_path / "s.json")],
                                 env=launch_env(), capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        summary = json.loads((tmp_path / "s.json").read_text())
        assert summary["learners_finished"] == 2 and summary["bit_identical"]
        assert summary["syncer_epoch"] == 2 and summary["resumed"]["snapshot"] == store.ids()[0]
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(e["event"] == "resumed" and e["source"] == "learner-0" for e in events)
        recovered = [e for e in events if e["event"] == "recovered" and e["source"] == "learner-1"]
        assert recovered and recovered[0]["from_peer"] and recovered[0]["donor"] == 0
        assert not any("fresh inner optimizer" in e.get("what", "") for e in events)
