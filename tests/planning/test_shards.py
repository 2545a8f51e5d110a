import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.shards import merge_demand_gb_s, shard_warning, shards_needed


def test_demand_and_shards_of_the_issues_10b_case():
    # 10B params, M = 8, H = 500 steps of 0.8 s: 8 x 40 GB per 400 s = 0.8 GB/s to merge.
    assert merge_demand_gb_s(10e9, 8, 500, 0.8) == pytest.approx(0.8)
    assert shards_needed(10e9, 8, 500, 0.8, shard_merge_gb_s=0.3) == 3
    assert shards_needed(10e9, 8, 500, 0.8, shard_merge_gb_s=0.8) == 1
    assert shards_needed(1e6, 2, 100, 1.0, shard_merge_gb_s=0.1) == 1


def test_the_warning_names_what_is_needed_and_what_the_run_has():
    line = shard_warning(10e9, 8, 500, 0.8, 0.3, shards=2)
    assert "syncer.shards >= 3, it has 2" in line and "0.8 GB/s" in line and "plan.shard_merge_gb_s" in line
    assert shard_warning(10e9, 8, 500, 0.8, 0.3, shards=3) is None


@pytest.mark.parametrize("args", [(0, 8, 500, 0.8, 0.3), (1e9, 8, 500, 0.0, 0.3), (1e9, 8, 500, 0.8, 0.0)])
def test_bad_inputs_are_refused(args):
    with pytest.raises(ConfigError):
        shards_needed(*args)
