"""Bandwidth-requirement calculator: Gbit/s between datacenters per compute-utilization target.

Each method becomes a :class:`~wan_diloco.planning.timeline.Timeline` (which
layers go on the wire at which step, how many bits, how long they may take;
fragments are due when the run's :class:`~wan_diloco.fragments.Schedule` says);
:mod:`~wan_diloco.planning.timeline` turns a schedule and a link rate into a
compute utilization (CU), and a log-space bisection finds the smallest rate
that reaches each target. See docs/planning.md for the assumptions.
"""
from __future__ import annotations

import dataclasses
import math

from wan_diloco.compression.config import BITS
from wan_diloco.config import ConfigError, require
from wan_diloco.fragments import Schedule, tau_bounds
from wan_diloco.planning.timeline import Sync, Timeline, compute_utilization, min_rate_for_cu

# The paper's table columns, in its order; `--method all` means these.
PAPER_METHODS = ("data_parallel", "diloco", "streaming", "streaming_overlap", "streaming_overlap_4bit")
METHODS = PAPER_METHODS + ("decoupled",)
DEFAULT_CU_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)

# name -> (params, layers, step_time_s): the models of Streaming DiLoCo's Table 4.
PRESETS: dict[str, tuple[float, int, float]] = {
    "1b": (1e9, 24, 0.1),
    "10b": (1e10, 48, 0.8),
}


@dataclasses.dataclass(frozen=True)
class BandwidthConfig:
    """One model on ``datacenters`` sites joined by identical links.

    ``fragments`` defaults to one fragment per 3 layers; ``bits`` is the width
    of outer gradients (data parallel always sends ``grad_bits`` gradients).
    """

    params: float
    layers: int
    step_time_s: float
    datacenters: int = 2
    sync_every: int = 100
    fragments: int | None = None
    tau: int = 1
    bits: int = 16
    grad_bits: int = 16
    rtt_s: float = 0.0

    def validate(self) -> None:
        require(self.params > 0, "params", f"must be > 0, got {self.params}")
        require(self.layers >= 1, "layers", f"must be >= 1, got {self.layers}")
        require(self.step_time_s > 0, "step_time_s", f"must be > 0, got {self.step_time_s}")
        require(self.datacenters >= 2, "datacenters", f"must be >= 2 (one site needs no WAN), got {self.datacenters}")
        require(self.sync_every >= 1, "sync_every", f"must be >= 1, got {self.sync_every}")
        frag = self.fragments
        require(frag is None or 1 <= frag <= self.layers, "fragments", f"must be in [1, layers={self.layers}], got {frag}")
        lo, hi = tau_bounds(self.sync_every, self.n_fragments)
        require(lo <= self.tau <= hi, "tau", f"must be in [{lo}, {hi}] (below sync_every={self.sync_every}), "
                f"got {self.tau}")
        require(self.bits in BITS, "bits", f"must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        # Data parallel's gradients: a codec width, but never 4 bits (no published run trains on them).
        grad_bits = tuple(b for b in BITS if b >= 8)
        require(self.grad_bits in grad_bits, "grad_bits",
                f"must be one of {', '.join(map(str, grad_bits))}, got {self.grad_bits}")
        require(self.rtt_s >= 0, "rtt_s", f"must be >= 0, got {self.rtt_s}")

    @property
    def n_fragments(self) -> int:
        return self.fragments if self.fragments is not None else math.ceil(self.layers / 3)


def step_time_from_flops(params: float, tokens_per_step: float, mfu: float, peak_tflops: float) -> float:
    """Seconds per step of one datacenter: 6·params·tokens / (MFU · peak FLOP/s)."""
    require(params > 0 and tokens_per_step > 0, "tokens_per_step", "params and tokens per step must be > 0")
    require(0 < mfu <= 1, "mfu", f"must be in (0, 1], got {mfu}")
    require(peak_tflops > 0, "peak_tflops", f"must be > 0, got {peak_tflops}")
    return 6.0 * params * tokens_per_step / (mfu * peak_tflops * 1e12)


def fragment_layers(layers: int, fragments: int) -> list[tuple[int, ...]]:
    """Consecutive layers per fragment, sizes differing by at most one."""
    base, extra = divmod(layers, fragments)
    out, start = [], 0
    for p in range(fragments):
        size = base + (1 if p < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return out


def schedule_for(cfg: BandwidthConfig, method: str, via_hub: bool = False) -> Timeline:
    """The wire timeline of ``method`` under ``cfg``.

    ``via_hub``: every method exchanges through a central server (parameter
    server or syncer: each site's bytes go up once and the result comes down
    once) instead of a ring all-reduce; this is how wan-diloco's runtime runs
    all of them. Decoupled DiLoCo always goes through its syncer."""
    require(method in METHODS, "method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    m = cfg.datacenters
    # Share of the bytes each site sends in a ring all-reduce; through a hub, all of them once.
    ring_volume = 1.0 if via_hub else 2 * (m - 1) / m
    params_per_layer = cfg.params / cfg.layers
    everything = tuple(range(cfg.layers))
    common = dict(layers=cfg.layers, step_time_s=cfg.step_time_s, latency_s=cfg.rtt_s / 2, ring_phases=2 * (m - 1))
    if method == "data_parallel":
        sync = Sync(everything, params_per_layer * cfg.grad_bits * ring_volume, deadline_steps=0, hub=via_hub)
        return Timeline(period_steps=1, syncs={0: (sync,)}, **common)
    h = cfg.sync_every
    if method == "diloco":
        sync = Sync(everything, params_per_layer * cfg.bits * ring_volume, deadline_steps=0, hub=via_hub)
        return Timeline(period_steps=h, syncs={h - 1: (sync,)}, **common)
    bits = 4 if method == "streaming_overlap_4bit" else cfg.bits
    tau = 0 if method == "streaming" else cfg.tau
    hub = via_hub or method == "decoupled"
    # A hub sends each learner's fragment up once and the merged one down once.
    volume = 1.0 if hub else ring_volume
    frags = fragment_layers(cfg.layers, cfg.n_fragments)
    due = Schedule(h, len(frags))  # the run's rule: fragment p goes after the step the run sends it
    syncs: dict[int, tuple[Sync, ...]] = {}
    for p, layers in enumerate(frags):
        sync = Sync(layers, params_per_layer * bits * volume, deadline_steps=tau, hub=hub)
        at = due.round_index(p)
        syncs[at] = syncs.get(at, ()) + (sync,)
    return Timeline(period_steps=h, syncs=syncs, **common)


def parse_methods(spec: str) -> tuple[str, ...]:
    """``all`` (every method), ``paper`` (the paper's five columns) or a comma list of method names, in
    order, no repeats."""
    out: list[str] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        names = {"all": METHODS, "paper": PAPER_METHODS}.get(name, (name,))
        for n in names:
            if n not in METHODS:
                raise ConfigError(f"method: unknown method {n!r}; choose from all, paper, {', '.join(METHODS)}")
            if n not in out:
                out.append(n)
    require(bool(out), "method", "no method given")
    return tuple(out)


def required_rates(
    cfg: BandwidthConfig, methods: tuple[str, ...], cu_targets: tuple[float, ...] = DEFAULT_CU_TARGETS
) -> dict[str, list[float]]:
    """Smallest Gbit/s reaching each CU target, per method (``inf`` = unreachable)."""
    cfg.validate()
    for cu in cu_targets:
        require(0 < cu < 1, "target_cu", f"each target must be in (0, 1), got {cu}")
    return {m: [min_rate_for_cu(schedule_for(cfg, m), cu) for cu in cu_targets] for m in methods}


def cu_at_rate(cfg: BandwidthConfig, methods: tuple[str, ...], rate_gbit_s: float) -> dict[str, float]:
    """Compute utilization of each method on a link of ``rate_gbit_s``."""
    cfg.validate()
    require(rate_gbit_s > 0, "bandwidth_gbit", f"must be > 0, got {rate_gbit_s}")
    return {m: compute_utilization(schedule_for(cfg, m), rate_gbit_s) for m in methods}
