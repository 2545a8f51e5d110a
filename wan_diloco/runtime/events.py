"""Progress and results of runtime processes: one JSON object per line on stdout (the launcher reads them)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

_lock = threading.Lock()


def emit(event: dict) -> None:
    """Write ``event`` (with a wall-clock ``t``) as one JSON line on stdout and flush."""
    line = json.dumps({"t": round(time.time(), 3), "pid": os.getpid(), **event}, separators=(",", ":"), default=float)
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
