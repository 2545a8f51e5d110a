"""Runtime tests: a micro model, real processes on 127.0.0.1, nothing left behind."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

TOKEN = "runtime-test-token-0123"

MICRO = """\
[run]
learners = {learners}
steps = {steps}
batch_size = 4
eval_batches = 1
eval_batch_size = 4
tick_s = 0.2
report_every_s = 0.2
min_step_s = {min_step_s}
token = "{token}"

[data]
max_bytes = 262144

[model]
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 64
seq_len = 32

[learner]
sync_every = 8
num_fragments = 2
tau = {tau}

[syncer]
liveness_timeout_s = 20.0
final_timeout_s = 20

[train]
warmup_steps = 2

[transport]
channels = 1
call_timeout_s = 10.0
retry_budget_s = 15.0
"""


def micro_config(tmp_path: Path, learners: int = 3, steps: int = 40, min_step_s: float = 0.0,
                 token: str = TOKEN, extra: str = "", tau: int = 1) -> Path:
    path = tmp_path / "micro.toml"
    path.write_text(MICRO.format(learners=learners, steps=steps, min_step_s=min_step_s, token=token, tau=tau) + extra)
    return path


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must stop (and reap) every process it started, also when it fails."""
    before = set(_children(os.getpid()))
    yield
    deadline = time.monotonic() + 5
    while (left := set(_children(os.getpid())) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {sorted(left)}"
