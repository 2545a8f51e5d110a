import json

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.shards import (
    DEFAULT_SHARD_MERGE_GB_S, MEASURED_FILE, merge_demand_gb_s, shard_merge_rate, shard_warning, shards_needed,
)


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


def _measured(tmp_path, table) -> object:
    path = tmp_path / "syncer.json"
    path.write_text(json.dumps({"planner": {"merged_fp32_gb_s_one_shard_by_learners": table}}))
    return path


def test_the_configured_rate_wins_over_a_measured_file(tmp_path):
    path = _measured(tmp_path, {"4": 0.9, "8": 1.2})
    assert shard_merge_rate(0.3, 4, path) == (0.3, "plan.shard_merge_gb_s")


def test_unset_takes_the_measured_rate_at_the_nearest_learner_count(tmp_path):
    path = _measured(tmp_path, {"4": 0.9, "8": 1.2})
    assert shard_merge_rate(None, 8, path)[0] == 1.2
    assert shard_merge_rate(None, 5, path)[0] == 0.9  # nearer 4
    assert shard_merge_rate(None, 6, path) == (0.9, "measured by bench/syncer.py at M = 4 (syncer.json)")  # tie
    assert shard_merge_rate(None, 64, path)[0] == 1.2


def test_without_a_measured_file_the_default_says_so(tmp_path):
    rate, source = shard_merge_rate(None, 4, tmp_path / "absent.json")
    assert rate == DEFAULT_SHARD_MERGE_GB_S and source.startswith("the default") and "absent.json" in source


def test_this_checkouts_measured_file_is_read_when_present():
    if not MEASURED_FILE.exists():
        pytest.skip("no bench/results/syncer.json in this checkout")
    table = json.loads(MEASURED_FILE.read_text())["planner"]["merged_fp32_gb_s_one_shard_by_learners"]
    rate, source = shard_merge_rate(None, 4)
    assert rate in table.values() and source.startswith("measured")


@pytest.mark.parametrize("text", ['{"planner": {}}', "not json", '{"planner": {"merged_fp32_gb_s_one_shard_by_learners": '
                                  '{"4": -1}}}', '{"planner": {"merged_fp32_gb_s_one_shard_by_learners": {"x": 1}}}',
                                  '{"planner": {"merged_fp32_gb_s_one_shard_by_learners": []}}'])
def test_a_broken_measured_file_is_an_error_naming_it(tmp_path, text):
    path = tmp_path / "syncer.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"syncer.json.*plan.shard_merge_gb_s"):
        shard_merge_rate(None, 4, path)
