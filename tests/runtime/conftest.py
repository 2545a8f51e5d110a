"""Runtime tests: a micro model, real processes on 127.0.0.1, nothing left behind."""
from __future__ import annotations

import os
import time

import pytest

# The canonical micro run lives in tests/conftest.py; runtime tests import it from here as before.
from tests.conftest import TOKEN, micro_config, micro_model, micro_toml  # noqa: F401


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
