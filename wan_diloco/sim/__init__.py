"""Simulated driver: M learners training real JAX models in one process on a virtual clock.

It reads the same run spec as a real run (``spec``); the ``[simulate]`` table
adds only the time and link model and the baseline. The same sans-IO cores
as the network driver decide everything else. Deterministic for a seed.
"""
from __future__ import annotations

from typing import Callable, Iterable

from wan_diloco.assemble import Assembly
from wan_diloco.config import require
from wan_diloco.sim.baselines import protocol_for
from wan_diloco.sim.common import Progress, SimResult
from wan_diloco.sim.decoupled import Simulation
from wan_diloco.sim.dp import run_dp
from wan_diloco.spec import RunSpec
from wan_diloco.tape import Fault, Outage, SyncerOutage


def check_tape(spec: RunSpec, outages: list[Fault]) -> None:
    """What a failure tape needs of the run: its learners and shards exist, and a syncer kill has a snapshot
    to resume from (ConfigError naming the field)."""
    for o in outages:
        require(0 <= o.down_at < o.up_at, "failures", f"{o.kind} outage: needs 0 <= down_at < up_at")
        if isinstance(o, Outage):
            require(0 <= o.learner < spec.run.learners, "failures",
                    f"outage names learner {o.learner}, run has {spec.run.learners}")
            continue
        require(spec.simulate.baseline != "dp", "failures", "kill_syncer in a dp run: data parallel has no syncer")
        require(o.shard is None or 0 <= o.shard < spec.syncer.shards, "failures",
                f"kill_syncer names shard {o.shard}, the run has {spec.syncer.shards} (syncer.shards)")
        require(spec.checkpoint.every_merges > 0, "checkpoint.every_merges",
                "kill_syncer resumes from a snapshot; set it > 0")


def run(spec: RunSpec, outages: Iterable[Fault] = (), progress: Progress | None = None,
        on_upload: Callable | None = None) -> SimResult:
    """One simulated run of ``spec.simulate.baseline`` under a failure tape (``wan_diloco.tape``).
    ``on_upload(msg)`` sees every ``core.FragmentUpload`` the syncer receives (for benchmarks that study
    outer gradients)."""
    outages = list(outages)
    check_tape(spec, outages)
    spec = protocol_for(spec)
    parts = Assembly(spec)
    if spec.simulate.baseline == "dp":
        return run_dp(spec, parts, outages, progress)
    return Simulation(spec, parts, outages, progress, on_upload).run()


__all__ = ["Fault", "Outage", "SyncerOutage", "check_tape", "Progress", "SimResult", "Simulation", "protocol_for", "run"]
