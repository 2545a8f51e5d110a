"""Progress and results of runtime processes: one JSON object per line on stdout (the launcher reads them)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

_lock = threading.Lock()
_sink = None  # set_sink: where events go instead of stdout (a person watching a table)


def set_sink(sink) -> None:
    """Send every event (the dict, with ``t`` and ``pid``) to ``sink`` instead of stdout; None: stdout again.
    The sink is called under the events lock, one event at a time."""
    global _sink
    with _lock:
        _sink = sink


def emit(event: dict) -> None:
    """Write ``event`` (with a wall-clock ``t``) as one JSON line on stdout and flush."""
    full = {"t": round(time.time(), 3), "pid": os.getpid(), **event}
    with _lock:
        if _sink is not None:
            _sink(full)
            return
        sys.stdout.write(json.dumps(full, separators=(",", ":"), default=float) + "\n")
        sys.stdout.flush()
