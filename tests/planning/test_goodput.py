import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.goodput import (
    SECONDS_PER_YEAR,
    GoodputConfig,
    effective_failures,
    failure_times,
    sample_repairs_s,
    simulate,
    speed_efficiency,
)

ANCHORS = json.loads((Path(__file__).parent / "reference" / "goodput_anchors.json").read_text())
SYSTEM_OF = {
    "data_parallel_no_elastic": {"system": "dp"},
    "data_parallel_elastic": {"system": "elastic-dp"},
    "decoupled_M16": {"system": "decoupled", "learners": 16},
}


@pytest.mark.parametrize("row", ANCHORS["rows"], ids=lambda r: r["system"])
def test_published_anchors_within_5_points(row):
    # Defaults are the documented assumptions; only the system differs.
    r = simulate(GoodputConfig(chips=row["chips"], mtbf_chip_years=1.0, **SYSTEM_OF[row["system"]]))
    assert abs(r.goodput - row["goodput"]) <= 0.05, (row, r)
    assert abs(r.uptime - row["uptime"]) <= 0.05, (row, r)


def test_dp_matches_renewal_formula():
    cfg = GoodputConfig(system="dp", chips=1e6, restart_s=30.0, checkpoint_interval_s=2.0, days=7)
    r = simulate(cfg)
    mean_run_s = cfg.mtbf_chip_years * SECONDS_PER_YEAR / cfg.chips
    assert r.uptime == pytest.approx(mean_run_s / (mean_run_s + 30.0), abs=0.01)
    # E[X mod C] for exponential X: what a failure throws away since the last checkpoint.
    q = math.exp(-2.0 / mean_run_s)
    lost_per_cycle = mean_run_s - 2.0 * q / (1 - q)
    assert r.lost_work_fraction == pytest.approx(lost_per_cycle / (mean_run_s + 30.0), rel=0.1)
    assert r.goodput == pytest.approx(r.uptime - r.lost_work_fraction, abs=1e-9)


def test_elastic_pauses_match_renewal_formula_and_repairs_match_slice_mtbf():
    cfg = GoodputConfig(chips=5e5, downscale_s=8.0, upscale_s=8.0, days=7)
    r = simulate(cfg)
    events_per_s = 2 * r.effective_failures / (cfg.days * 86400)  # every failure is repaired once
    assert r.uptime == pytest.approx(1 / (1 + events_per_s * 8.0), abs=0.02)
    mean_repair_s = cfg.repair_scale_h * 3600 * 1.5  # k = 1, alpha = 2: scale * (1 + 1/2)
    slice_mtbf_s = cfg.mtbf_chip_years * SECONDS_PER_YEAR / cfg.slice_chips
    assert r.down_chip_fraction == pytest.approx(mean_repair_s / (slice_mtbf_s + mean_repair_s), rel=0.05)
    assert r.goodput < r.uptime * (1 - r.down_chip_fraction) + 0.01


def test_repair_sampler_follows_exponentiated_weibull_cdf():
    cfg = GoodputConfig(repair_scale_h=1.0, repair_shape=0.7, repair_exponent=2.5)
    x = sample_repairs_s(np.random.default_rng(1), 200_000, cfg) / 3600
    for q in (0.5, 1.0, 3.0):
        assert np.mean(x <= q) == pytest.approx((1 - math.exp(-(q**0.7))) ** 2.5, abs=0.005)


def test_no_slice_fails_while_under_repair():
    cfg = GoodputConfig(chips=2e4, slice_chips=512, mtbf_chip_years=0.05, days=3)
    rng = np.random.default_rng(3)
    times, slices = failure_times(rng, cfg, 3 * 86400)
    t, s, end = effective_failures(rng, cfg, times, slices)
    assert 0 < len(t) < len(times)
    for sl in np.unique(s):
        mine = s == sl
        assert np.all(t[mine][1:] >= end[mine][:-1])


def test_decoupled_gains_with_learners_and_quorum_lowers_uptime():
    base = GoodputConfig(system="decoupled", days=2)
    g = [simulate(dataclasses.replace(base, learners=m)).goodput for m in (1, 4, 16)]
    assert g[0] < g[1] < g[2]
    k1 = simulate(dataclasses.replace(base, learners=16, quorum=1))
    k16 = simulate(dataclasses.replace(base, learners=16, quorum=16))
    assert k16.uptime < 0.5 < k1.uptime and k16.goodput == k1.goodput


def test_tape_holds_each_learners_pauses():
    cfg = GoodputConfig(system="decoupled", learners=4, chips=2e5, days=1)
    r = simulate(cfg)
    assert {o.learner for o in r.outages} == {0, 1, 2, 3}
    for m in range(4):
        mine = sorted((o for o in r.outages if o.learner == m), key=lambda o: o.down_at)
        assert all(a.up_at <= b.down_at for a, b in zip(mine, mine[1:]))
    total = sum(o.duration_s for o in r.outages)
    assert total == pytest.approx(r.paused_fraction * 4 * 86400, rel=1e-9)


def test_a_learner_with_every_slice_down_is_not_training():
    # Two slices per learner that fail often and repair slowly: the learner
    # often has none left, which must show as an outage even without a pause.
    cfg = GoodputConfig(system="decoupled", learners=2, chips=4 * 256, mtbf_chip_years=0.01,
                        downscale_s=0.0, upscale_s=0.0, repair_scale_h=20.0, days=3)
    r = simulate(cfg)
    assert r.paused_fraction == 0.0
    assert sum(o.duration_s for o in r.outages) > 0.1 * 2 * 3 * 86400
    assert r.uptime < 1.0


def test_deterministic_for_a_seed():
    cfg = GoodputConfig(chips=1e5, days=1)
    assert simulate(cfg) == simulate(cfg)
    assert simulate(cfg).goodput != simulate(dataclasses.replace(cfg, seed=1)).goodput


def test_speed_variance_costs_synchronous_groups():
    assert speed_efficiency(1000, 0.0) == 1.0
    # Expected max of two standard normals is 1/sqrt(pi); Blom's estimate is within 5 %.
    assert speed_efficiency(2, 0.1) == pytest.approx(1 / (1 + 0.1 / math.sqrt(math.pi)), rel=0.005)
    assert speed_efficiency(10_000, 0.05) < speed_efficiency(100, 0.05) < 1
    plain = simulate(GoodputConfig(chips=1e5, days=1))
    varied = simulate(GoodputConfig(chips=1e5, days=1, speed_cv=0.05))
    assert varied.goodput < plain.goodput and varied.uptime == plain.uptime


def test_millions_of_chips_over_weeks_in_seconds():
    t0 = time.perf_counter()
    r = simulate(GoodputConfig(system="decoupled", learners=16, chips=2.4e6, days=28))
    assert r.failures > 150_000
    assert time.perf_counter() - t0 < 15


@pytest.mark.parametrize(
    "changes, field",
    [({"system": "dp", "learners": 2}, "learners"), ({"system": "decoupled", "learners": 4, "quorum": 5}, "quorum"),
     ({"chips": 100.0}, "chips"), ({"repair_shape": 0.0}, "repair_shape"), ({"downscale_s": -1.0}, "downscale_s"),
     ({"system": "ring"}, "system"), ({"system": "decoupled", "learners": 10, "chips": 2048.0}, "learners")],
)
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        GoodputConfig(**changes).validate()
