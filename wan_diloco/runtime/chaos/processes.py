"""The processes of a chaos run: a ``Cluster`` whose syncers see the disk_full fault's hook, and the one
thread that starts processes which block (a syncer restart waits until it listens)."""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable

from wan_diloco.runtime.launch import Cluster, is_syncer


class Spawner:
    """One thread, alive as long as the cluster, for starts that block (a syncer restart waits until it
    listens) while the driver goes on. Not a thread per restart: ``Cluster`` children get SIGTERM when
    the thread that forked them exits (PR_SET_PDEATHSIG), so a short-lived thread would stop its syncer."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="chaos-spawner", daemon=True)

    def __enter__(self) -> "Spawner":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.jobs.put(None)
        self.thread.join(200)  # a start in flight fails fast once the cluster stopped its process

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


class ChaosCluster(Cluster):
    """A ``Cluster`` whose syncer processes get ``syncer_env`` too: the disk_full fault's test hook reaches
    the syncers of a chaos run that schedules it, and no other process of any run."""

    def __init__(self, *args, syncer_env: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.syncer_env = dict(syncer_env or {})

    def _env_of(self, name: str) -> dict:
        env = super()._env_of(name)
        return {**env, **self.syncer_env} if is_syncer(name) else env


def disk_flag_path(run_dir: str | Path) -> Path:
    """While this file exists the syncers of a chaos run with a disk_full fault cannot write (ENOSPC)."""
    return Path(run_dir) / "disk-full.flag"
