import pytest

from wan_diloco.config import ConfigError, replace
from wan_diloco.planning.bandwidth import BandwidthConfig, schedule_for
from wan_diloco.planning.recommend import recommend
from wan_diloco.planning.timeline import compute_utilization

TEN_B = BandwidthConfig(params=1e10, layers=48, step_time_s=0.8, rtt_s=0.06)


def test_recommendations_reach_the_target_and_prefer_frequent_syncs():
    found, reached = recommend(TEN_B, 2.5, 0.95)
    assert reached and found
    assert all(r.cu >= 0.95 for r in found)
    assert [r.sync_every for r in found] == sorted(r.sync_every for r in found)
    best = found[0]
    cfg = replace(TEN_B, sync_every=best.sync_every, fragments=best.fragments, tau=best.tau, bits=best.bits)
    assert compute_utilization(schedule_for(cfg, "decoupled"), 2.5) == pytest.approx(best.cu)
    # A wider link allows syncing at least as often.
    wide, _ = recommend(TEN_B, 25.0, 0.95)
    assert wide[0].sync_every <= best.sync_every


def test_unreachable_target_returns_best_effort():
    found, reached = recommend(TEN_B, 0.001, 0.99)
    assert not reached
    assert found[0].cu < 0.99
    assert [r.cu for r in found] == sorted((r.cu for r in found), reverse=True)


def test_recommend_rejects_bad_input():
    with pytest.raises(ConfigError, match="^method:"):
        recommend(TEN_B, 2.5, 0.9, method="data_parallel")
    with pytest.raises(ConfigError, match="^link_gbit:"):
        recommend(TEN_B, 0.0, 0.9)
