"""How a launched run ends early: ``RunFailed`` (it cannot continue) and ``RunStopped`` (the operator
stopped it: SIGINT or SIGTERM, resumable), the signals caught as such a stop, and the last snapshot a stop
asks the syncer for."""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from typing import Callable, Iterator

from wan_diloco.runtime.launch_cluster import Cluster
from wan_diloco.runtime.launch_names import is_syncer


class RunFailed(Exception):
    """The run cannot continue; the text says why."""


class RunStopped(Exception):
    """The operator stopped the run (SIGINT, SIGTERM): not a failure, it can be resumed."""


STOP_SNAPSHOT_S = 60.0  # a stopped run waits this long for its final snapshot (a second Ctrl-C: not at all)
STOPPED_EXIT = 130  # launch stopped by SIGINT or SIGTERM: a stop the operator asked for, resumable


@contextlib.contextmanager
def stop_signals() -> Iterator[dict]:
    """SIGINT and SIGTERM noted instead of raised while inside, in the dict yielded: ``sig`` (the last one, 0
    for none) and ``count`` (how many: a second one cuts the wait for a last snapshot short). The run loop
    looks at it between events, so a stop never lands in the middle of a write; the old handlers come back
    on leaving."""
    stop = {"sig": 0, "count": 0}

    def on_signal(signum, _frame):
        stop["sig"] = signum
        stop["count"] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stop_snapshot(cluster: "Cluster", take: Callable[[str, dict], None], stop: dict,
                  wait_s: float = STOP_SNAPSHOT_S) -> int | None:
    """Ask the syncer for a snapshot now (SIGUSR1, to every shard) and wait at most ``wait_s`` for shard 0 to
    report it complete, feeding every event meanwhile to ``take``; its id, or None (no syncer, no
    checkpoint.dir, too slow, a second signal)."""
    syncer = cluster.children.get("syncer")
    if syncer is None or syncer.exit_code is not None or not cluster.cfg.checkpoint.dir:
        return None
    for name, c in cluster.children.items():
        if is_syncer(name) and c.exit_code is None:
            try:
                os.kill(c.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    asked, deadline, cut = stop["count"], time.monotonic() + wait_s, None
    while time.monotonic() < deadline and stop["count"] == asked and syncer.exit_code is None:
        try:
            name, e = cluster.events.get(timeout=0.25)
        except queue.Empty:
            continue
        take(name, e)
        if name != "syncer":
            continue
        if e.get("event") == "snapshot_requested":
            if e.get("snapshot") is None:
                return None  # nothing to cut (the final sync began): no use waiting
            cut = int(e["snapshot"])
        elif e.get("event") == "snapshot" and cut is not None and int(e["snapshot"]) >= cut:
            return int(e["snapshot"])
    return None
