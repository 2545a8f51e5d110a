"""Per-layer compute timeline of a training step against one inter-datacenter link.

This is the engine behind the bandwidth calculator. A step of a model with L
layers is a chain of nodes on one accelerator (the datacenter's compute is one
serial resource):

* forward ``F_0 .. F_{L-1}``, each ``step/3/L`` seconds;
* backward for activations ``B_{L-1} .. B_0`` and backward for parameters
  ``W_l``, each ``step/3/L`` seconds (the usual 2:2:2 FLOP split of a
  transformer layer: 2 for forward, 2 for activation and 2 for weight
  gradients per parameter and token).

The gradient of layer ``l`` is ready when ``W_l`` ends. Weight-gradient nodes
of layers that are *not* being sent this step are off every critical path, so
the scheduler runs them after the activation chain; layers being sent run
``W_l`` right after ``B_l``. (This is what a critical-path list scheduler does
with the DAG; it matters for streaming, where only a few layers are sent.)

Each sent layer is one message on a FIFO link: it starts when the layer is
ready and the link is free, and takes ``bits / rate`` seconds. Its result must
be back before ``F_l`` of step ``s + 1 + deadline_steps``; the accelerator
stalls there until it is. Compute utilization is compute time over elapsed
time, measured over whole schedule periods after one warm-up period.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Sync:
    """Layers sent at one step.

    ``bits_per_layer``: bits on the busiest link direction per layer (already
    multiplied by the collective's volume factor). ``deadline_steps``: how many
    whole steps of compute may overlap the transfer (0 = blocking, the result
    is needed by the very next step). ``hub``: the result comes back through a
    central syncer (upload, merge per tensor, download) rather than from a
    ring all-reduce; it then crosses the link twice, once in each direction.
    """

    layers: tuple[int, ...]
    bits_per_layer: float
    deadline_steps: int
    hub: bool = False


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What is sent at which step: ``syncs_at(step)`` repeats every ``period_steps`` (steps 0-based).

    Which fragment is due when is the run's rule (:class:`wan_diloco.fragments.Schedule`); this only
    lays its sends out against one link."""

    layers: int
    step_time_s: float
    period_steps: int
    syncs: dict[int, tuple[Sync, ...]]  # step within period -> syncs starting there
    latency_s: float = 0.0  # one-way, added once per link crossing (ring: per phase)
    ring_phases: int = 2  # sequential latency hops of the all-reduce (2(M-1))

    def syncs_at(self, step: int) -> tuple[Sync, ...]:
        return self.syncs.get(step % self.period_steps, ())


def compute_utilization(schedule: Timeline, rate_gbit_s: float, measure_periods: int = 2) -> float:
    """Steady-state compute utilization of ``schedule`` on a link of ``rate_gbit_s``.

    Simulates one warm-up period and ``measure_periods`` measured periods.
    """
    if rate_gbit_s <= 0:
        return 0.0
    rate_bit_s = rate_gbit_s * 1e9
    L = schedule.layers
    node_s = schedule.step_time_s / (3 * L)
    period = schedule.period_steps
    total_steps = period * (1 + measure_periods)
    need: dict[int, dict[int, float]] = {}  # step -> {layer: time its result arrives}
    up_free = down_free = 0.0
    t = 0.0
    t_measure = 0.0
    for step in range(total_steps):
        if step == period:
            t_measure = t
        syncs = schedule.syncs_at(step)
        arrivals = need.pop(step, None)
        if not syncs and not arrivals:
            t += schedule.step_time_s
            continue
        for layer in range(L):
            if arrivals and arrivals.get(layer, 0.0) > t:
                t = arrivals[layer]
            t += node_s
        sent = {}
        for sync in syncs:
            for layer in sync.layers:
                sent[layer] = sync
        deferred = 0
        for layer in range(L - 1, -1, -1):
            t += node_s
            sync = sent.get(layer)
            if sync is None:
                deferred += 1
                continue
            t += node_s
            start = max(t, up_free)
            up_free = start + sync.bits_per_layer / rate_bit_s
            if sync.hub:
                # The syncer merges tensor by tensor, so a layer's download can
                # start as soon as its upload is in; one latency each way.
                start_down = max(up_free + schedule.latency_s, down_free)
                down_free = start_down + sync.bits_per_layer / rate_bit_s
                arrive = down_free + schedule.latency_s
            else:
                arrive = up_free + schedule.ring_phases * schedule.latency_s
            due = need.setdefault(step + 1 + sync.deadline_steps, {})
            due[layer] = max(due.get(layer, 0.0), arrive)
        t += deferred * node_s
    compute_s = measure_periods * period * schedule.step_time_s
    return compute_s / (t - t_measure)


def min_rate_for_cu(
    schedule: Timeline, target_cu: float, lo_gbit_s: float = 1e-4, hi_gbit_s: float = 1e6, rel_tol: float = 0.005
) -> float:
    """Smallest link rate (Gbit/s) whose compute utilization reaches ``target_cu``.

    Bisection in log space (CU never decreases as the rate grows). Returns
    ``math.inf`` when even ``hi_gbit_s`` falls short, e.g. when the round-trip
    time alone stalls more than the target allows.
    """
    if compute_utilization(schedule, hi_gbit_s) < target_cu:
        return math.inf
    if compute_utilization(schedule, lo_gbit_s) >= target_cu:
        return lo_gbit_s
    while hi_gbit_s / lo_gbit_s > 1 + rel_tol:
        mid = math.sqrt(lo_gbit_s * hi_gbit_s)
        if compute_utilization(schedule, mid) >= target_cu:
            hi_gbit_s = mid
        else:
            lo_gbit_s = mid
    return hi_gbit_s
