"""The names of a launched run's children, and the region each one runs in under an emulated WAN."""
import pytest

from wan_diloco import spec as rt
from wan_diloco.runtime.launch_names import is_learner_name, is_syncer, shard_name, shard_of
from wan_diloco.runtime.launch_prep import region_of


def test_learner_names_are_told_from_syncers_and_helpers():
    assert is_learner_name("learner-0") and is_learner_name("learner-12.p3")
    for other in ("syncer", "syncer-1", "learner-03", "learner-1.p0", "learner-", "probe", "learner-1 "):
        assert not is_learner_name(other), other


@pytest.mark.parametrize("shard", [0, 1, 7])
def test_a_shards_name_round_trips(shard):
    name = shard_name(shard)
    assert is_syncer(name) and shard_of(name) == shard and not is_learner_name(name)


def test_each_child_runs_in_its_region():
    cfg = rt.from_document({"run": {"learners": 3},
                            "regions": {"names": ["us", "eu", "ap"], "syncer": "eu", "learners": ["ap", "us", "ap"]}})
    assert [region_of(cfg, n) for n in ("syncer", "syncer-2", "learner-0", "learner-1", "learner-2.p1")] == \
        ["eu", "eu", "ap", "us", "ap"]
