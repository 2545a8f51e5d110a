"""What the simulated baselines share: the result record, step times, and uptime."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from wan_diloco.spec import SimulateConfig

Progress = Callable[[float, dict], None]  # (share done, {step, and the latest eval point: eval_loss at eval_step})


@dataclass
class SimResult:
    config: dict  # the run spec as a document (spec.to_document)
    initial_eval_loss: float
    final_eval_loss: float
    tokens: int
    goodput: float
    uptime: float
    fragment_syncs: list[int]
    bytes_sent: int
    global_steps: int
    virtual_time_s: float
    wall_s: float
    curve: list[dict] = field(default_factory=list)  # {step, tokens, time_s, eval_loss}
    late_dropped: int = 0
    late_carried: int = 0
    mean_quorum: float = 0.0
    mean_grace_s: float = 0.0
    params_count: int = 0
    # Each learner up at the end: its final sync (core.final_sync): {learner, versions, final_by_bulk, digest_mismatch}.
    final_sync: list[dict] = field(default_factory=list)
    # The final global parameters (flat name -> float32 array): what a run's params.safetensors holds.
    params: dict | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(dataclasses.replace(self, params=None)).items() if k != "params"}


def step_time(sim: SimulateConfig, speed: float, rng: np.random.Generator) -> float:
    """Virtual seconds of one step: base × speed factor × lognormal noise."""
    noise = rng.lognormal(0.0, sim.step_noise) if sim.step_noise else 1.0
    return sim.step_time_s * speed * noise


def uptime(intervals: Iterable[tuple[float, float]], end_s: float) -> float:
    """Share of [0, end] covered by at least one interval."""
    covered, reach = 0.0, 0.0
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end_s)
        if b > a:
            covered += b - a
            reach = b
    return covered / end_s if end_s > 0 else 0.0
