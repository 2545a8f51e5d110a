"""A real `wan-diloco train` with stdout piped, as under a scheduler or CI: progress lines while it runs and a
summary whose weights path is whole (the formatter and the summary alone: tests/cli/test_progress.py)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import micro_config

KEYS = "elapsed_s step tokens tokens_per_s eval_loss up down quorum learners final_sync eta_s".split()


@pytest.mark.slow  # ~60 s on 2 shared cores: the processes' start-up, not the 40 steps
def test_a_piped_train_prints_progress_lines_and_a_whole_weights_path(tmp_path):
    # Paced steps (>= 4 s of training): progress lines fall while the learners train, not only before and after.
    path = micro_config(tmp_path, learners=2, min_step_s=0.1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "wan_diloco.cli", "train", "--config", str(path),
                             "--run-dir", str(tmp_path / "run"), "--progress-every-s", "0.5"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        metrics = tmp_path / "run" / "metrics.jsonl"
        for pid in {json.loads(x).get("pid") for x in metrics.read_text().splitlines()} if metrics.exists() else ():
            try:  # the launcher stops its children; these are only ours, should it have failed to
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, TypeError):
                pass
    assert proc.returncode == 0, err
    head, _, summary = out.partition("\nnetworked run:\n")
    lines = [x for x in head.splitlines() if x.startswith("progress ")]
    assert len(lines) >= 2, out
    for line in lines:
        assert [w.split("=")[0] for w in line.split()[1:]] == KEYS, line
    steps = [int(re.search(r" step=(\d+)/40 ", x).group(1)) for x in lines]
    assert any(0 < s < 40 for s in steps), out  # a line while the learners trained
    assert steps == sorted(steps)
    assert re.search(r" tokens_per_s=\d+ ", "\n".join(lines)) and re.search(r" eval_loss=\d+\.\d{4}@0 ", out)
    weights = re.search(r"^  final parameters: (.+)$", summary, re.M).group(1)
    assert Path(weights).is_absolute() and Path(weights).is_file() and weights.endswith("params.safetensors")
    assert "…" not in out and "─" not in out  # no table, nothing cut
