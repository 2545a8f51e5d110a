"""Goodput (chaos) simulator: how much chip-time survives chip failures at scale.

Failures arrive as a Poisson process with rate chips / MTBF_chip over the
whole run; each hits a uniformly random slice of ``slice_chips`` chips and
takes the whole slice down until it is repaired (repair times from an
exponentiated Weibull). A failure that lands on a slice already down is lost
in its repair. Three systems react to the same kind of tape:

* ``dp``: synchronous data parallel without elasticity. Any failure stops
  everyone; the job restarts on spare capacity after ``restart_s`` from its
  last checkpoint (taken every ``checkpoint_interval_s`` of training), losing
  the work since then. Repairs do not matter (spares).
* ``elastic-dp``: one synchronous job that keeps training on the slices it has.
  Each effective failure costs a ``downscale_s`` pause, each repaired slice an
  ``upscale_s`` pause to re-add it.
* ``decoupled``: ``learners`` independent learners of chips/M each, every one
  reacting to its own slices' events as elastic-dp does at its size.

An event arriving during a pause or restart is absorbed by it (membership is
read when it ends). Goodput = useful chip-time / allocated chip-time; uptime =
share of time with at least ``quorum`` learners training. Everything is exact
integration over event times (numpy), so 2.4M chips over weeks take well
under a second. See docs/planning.md for the chosen defaults.
"""
from __future__ import annotations

import dataclasses
from statistics import NormalDist
from typing import Literal

import numpy as np

from wan_diloco.config import require
from wan_diloco.planning import intervals as iv
from wan_diloco.tape import Outage

SECONDS_PER_YEAR = 365.25 * 86400
SYSTEMS = ("dp", "elastic-dp", "decoupled")


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    """One chaos scenario. Defaults reproduce the published anchors (docs/planning.md)."""

    chips: float = 2.4e6
    mtbf_chip_years: float = 1.0
    system: Literal["dp", "elastic-dp", "decoupled"] = "elastic-dp"
    learners: int = 1
    quorum: int = 1
    slice_chips: int = 256
    repair_scale_h: float = 2.0  # exponentiated Weibull: scale
    repair_shape: float = 1.0  # Weibull shape k (< 1: heavier tail)
    repair_exponent: float = 2.0  # exponent alpha (> 1: fewer very short repairs)
    downscale_s: float = 9.0
    upscale_s: float = 10.0
    restart_s: float = 60.0
    checkpoint_interval_s: float = 1.0
    speed_cv: float = 0.0
    days: float = 14.0
    seed: int = 0

    def validate(self) -> None:
        require(self.system in SYSTEMS, "system", f"must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        require(self.slice_chips >= 1, "slice_chips", f"must be >= 1, got {self.slice_chips}")
        require(self.chips >= self.slice_chips, "chips", f"must be at least one slice ({self.slice_chips}), got {self.chips:g}")
        require(self.mtbf_chip_years > 0, "mtbf_chip_years", f"must be > 0, got {self.mtbf_chip_years}")
        require(self.learners >= 1, "learners", f"must be >= 1, got {self.learners}")
        require(self.system == "decoupled" or self.learners == 1, "learners", f"only decoupled has several learners; {self.system} has 1")
        require(self.n_slices >= self.learners, "learners", f"{self.learners} learners need at least as many slices, have {self.n_slices}")
        require(1 <= self.quorum <= self.learners, "quorum", f"must be in [1, learners={self.learners}], got {self.quorum}")
        for name in ("repair_scale_h", "repair_shape", "repair_exponent", "days"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("downscale_s", "upscale_s", "restart_s", "speed_cv"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(self.checkpoint_interval_s > 0, "checkpoint_interval_s", f"must be > 0, got {self.checkpoint_interval_s}")

    @property
    def n_slices(self) -> int:
        return int(round(self.chips / self.slice_chips))


@dataclasses.dataclass(frozen=True)
class GoodputResult:
    """Outcome of one run; ``outages`` is when each learner was not training (the tape)."""

    goodput: float
    uptime: float
    failures: int
    effective_failures: int
    down_chip_fraction: float  # mean share of chips in slices under repair
    paused_fraction: float  # mean share of time a learner spends paused or restarting
    lost_work_fraction: float  # share of chip-time redone after restarts (dp)
    outages: tuple[Outage, ...] = dataclasses.field(repr=False, default=())

    def summary(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "outages"}


def sample_repairs_s(rng: np.random.Generator, n: int, cfg: GoodputConfig) -> np.ndarray:
    """Repair times (s) from an exponentiated Weibull, by inverting its CDF (1 - e^{-(x/s)^k})^a."""
    u = rng.random(n)
    return cfg.repair_scale_h * 3600 * (-np.log1p(-u ** (1 / cfg.repair_exponent))) ** (1 / cfg.repair_shape)


def speed_efficiency(n_slices: int, speed_cv: float) -> float:
    """Throughput share of a synchronous group paced by the slowest of ``n_slices``
    slices whose step times vary with coefficient ``speed_cv`` (Blom's estimate of
    the expected maximum of normals)."""
    if speed_cv == 0 or n_slices <= 1:
        return 1.0
    z = NormalDist().inv_cdf((n_slices - 0.375) / (n_slices + 0.25))
    return 1.0 / (1.0 + speed_cv * z)


def failure_times(rng: np.random.Generator, cfg: GoodputConfig, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Poisson failure times (sorted) over the run and the slice each hits."""
    rate_per_s = cfg.n_slices * cfg.slice_chips / (cfg.mtbf_chip_years * SECONDS_PER_YEAR)
    n = rng.poisson(rate_per_s * horizon_s)
    return np.sort(rng.uniform(0, horizon_s, n)), rng.integers(0, cfg.n_slices, n)


def effective_failures(rng, cfg, times, slices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, slice, repair end) of failures that hit a healthy slice, sorted by time."""
    order = np.lexsort((times, slices))
    t, s = times[order], slices[order]
    first = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
    rank = np.arange(len(s)) - np.repeat(first, np.diff(np.r_[first, len(s)]))
    healthy_at = np.zeros(cfg.n_slices)
    repair_end = np.full(len(s), np.nan)
    # Round r looks at every slice's r-th failure at once: a handful of rounds, not a loop per failure.
    for r in range(int(rank.max()) + 1 if len(s) else 0):
        idx = np.flatnonzero(rank == r)
        hit = idx[t[idx] >= healthy_at[s[idx]]]
        repair_end[hit] = t[hit] + sample_repairs_s(rng, len(hit), cfg)
        healthy_at[s[hit]] = repair_end[hit]
    keep = ~np.isnan(repair_end)
    by_time = np.argsort(t[keep], kind="stable")
    return t[keep][by_time], s[keep][by_time], repair_end[keep][by_time]


def simulate(cfg: GoodputConfig) -> GoodputResult:
    """Run one scenario; deterministic for ``cfg.seed``."""
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    horizon_s = cfg.days * 86400
    times, slices = failure_times(rng, cfg, horizon_s)
    if cfg.system == "dp":
        return _simulate_dp(cfg, times, horizon_s)
    return _simulate_elastic(cfg, rng, times, slices, horizon_s)


def _simulate_dp(cfg: GoodputConfig, times: np.ndarray, horizon_s: float) -> GoodputResult:
    starts, ends = iv.absorbing_pauses(times, np.full(len(times), cfg.restart_s))
    starts, ends = iv.clip(starts, ends, horizon_s)
    # Training segments run from the end of one restart to the failure that starts the next.
    seg_start = np.r_[0.0, ends]
    seg_end = np.r_[starts, horizon_s]
    seg = np.clip(seg_end - seg_start, 0, None)
    lost = np.r_[np.mod(seg[:-1], cfg.checkpoint_interval_s), 0.0]  # the last segment ends with the run
    trained_s = float(seg.sum())
    useful_s = trained_s - float(lost.sum())
    eff = speed_efficiency(cfg.n_slices, cfg.speed_cv)
    return GoodputResult(
        goodput=useful_s / horizon_s * eff,
        uptime=trained_s / horizon_s,
        failures=len(times),
        effective_failures=len(times),
        down_chip_fraction=0.0,
        paused_fraction=iv.measure(starts, ends) / horizon_s,
        lost_work_fraction=float(lost.sum()) / horizon_s,
        outages=tuple(Outage(0, float(s), float(e)) for s, e in zip(starts, ends)),
    )


def _simulate_elastic(cfg, rng, times, slices, horizon_s) -> GoodputResult:
    fail_t, fail_slice, repair_end = effective_failures(rng, cfg, times, slices)
    per_learner = cfg.n_slices // cfg.learners
    learner_of = fail_slice // per_learner  # slices past learners*per_learner are spares, unused
    in_use = learner_of < cfg.learners
    total_chip_s = cfg.learners * per_learner * cfg.slice_chips * horizon_s
    useful_chip_s = down_chip_s = paused_s = 0.0
    idle_starts, idle_ends, outages = [], [], []
    for m in range(cfg.learners):
        mine = in_use & (learner_of == m)
        f, r = fail_t[mine], repair_end[mine]
        down = iv.StepFunction(f, r[r < horizon_s])
        events = np.r_[f, r[r < horizon_s]]
        durations = np.r_[np.full(len(f), cfg.downscale_s), np.full(int((r < horizon_s).sum()), cfg.upscale_s)]
        order = np.argsort(events, kind="stable")
        p_s, p_e = iv.clip(*iv.absorbing_pauses(events[order], durations[order]), horizon_s)
        paused_s += iv.measure(p_s, p_e)
        # A learner with every slice down is not training either.
        z_s, z_e = down.intervals_at_least(per_learner, horizon_s)
        s, e = iv.union(np.r_[p_s, z_s], np.r_[p_e, z_e])
        idle_starts.append(s)
        idle_ends.append(e)
        outages += [Outage(m, float(a), float(b)) for a, b in zip(s, e)]
        down_total = float(down.integral_to(horizon_s))
        down_idle = float(np.sum(down.integral_to(e) - down.integral_to(s)))
        train_s = horizon_s - iv.measure(s, e)
        useful_chip_s += cfg.slice_chips * (per_learner * train_s - (down_total - down_idle))
        down_chip_s += cfg.slice_chips * down_total
    idle = iv.StepFunction(np.concatenate(idle_starts), np.concatenate(idle_ends))
    # Uptime: time with at most M - K learners idle.
    short = iv.measure(*idle.intervals_at_least(cfg.learners - cfg.quorum + 1, horizon_s))
    eff = speed_efficiency(per_learner, cfg.speed_cv)
    return GoodputResult(
        goodput=useful_chip_s / total_chip_s * eff,
        uptime=1.0 - short / horizon_s,
        failures=len(times),
        effective_failures=int(in_use.sum()),
        down_chip_fraction=down_chip_s / total_chip_s,
        paused_fraction=paused_s / (cfg.learners * horizon_s),
        lost_work_fraction=0.0,
        outages=tuple(sorted(outages, key=lambda o: (o.down_at, o.learner))),
    )
