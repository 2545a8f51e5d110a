"""Simulated driver: M learners training real JAX models in one process on a virtual clock.

It reads the same run spec as a real run (``spec``); the ``[simulate]`` table
adds only the time and link model and the baseline. The same sans-IO cores
as the network driver decide everything else. Deterministic for a seed.
"""
from __future__ import annotations

from typing import Callable, Iterable

from wan_diloco.assemble import Assembly
from wan_diloco.config import require
from wan_diloco.planning.tape import Outage
from wan_diloco.sim.baselines import protocol_for
from wan_diloco.sim.common import Progress, SimResult
from wan_diloco.sim.decoupled import Simulation
from wan_diloco.sim.dp import run_dp
from wan_diloco.spec import RunSpec


def run(spec: RunSpec, outages: Iterable[Outage] = (), progress: Progress | None = None,
        on_upload: Callable | None = None) -> SimResult:
    """One simulated run of ``spec.simulate.baseline``. ``on_upload(msg)`` sees every
    ``core.FragmentUpload`` the syncer receives (for benchmarks that study outer gradients)."""
    outages = list(outages)
    for o in outages:
        require(0 <= o.learner < spec.run.learners, "failures",
                f"outage names learner {o.learner}, run has {spec.run.learners}")
        require(0 <= o.down_at < o.up_at, "failures", f"outage of learner {o.learner}: needs 0 <= down_at < up_at")
    spec = protocol_for(spec)
    parts = Assembly(spec)
    if spec.simulate.baseline == "dp":
        return run_dp(spec, parts, outages, progress)
    return Simulation(spec, parts, outages, progress, on_upload).run()


__all__ = ["Outage", "Progress", "SimResult", "Simulation", "protocol_for", "run"]
