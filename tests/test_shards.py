import pytest

from wan_diloco import shards


def test_owners_balances_bytes_and_gives_every_shard_a_fragment():
    nbytes = [100, 10, 10, 10, 10, 40, 40, 60]
    plan = shards.owners(nbytes, 3)
    load = [sum(b for b, s in zip(nbytes, plan) if s == k) for k in range(3)]
    assert sorted(load) == [90, 90, 100]  # 280 bytes: no split does better than 100 on one shard
    assert set(plan) == {0, 1, 2}
    assert shards.imbalance(nbytes, plan) == pytest.approx(100 / (280 / 3))


def test_owners_is_deterministic_and_one_shard_owns_everything():
    nbytes = [5, 5, 5, 5]
    assert shards.owners(nbytes, 2) == shards.owners(list(nbytes), 2) == [0, 1, 0, 1]
    assert shards.owners(nbytes, 1) == [0, 0, 0, 0]
    assert shards.owned([0, 1, 0, 1], 1) == [1, 3]


@pytest.mark.parametrize("bad", [0, 5, -1, 1.5, None])
def test_owners_refuses_a_shard_count_outside_1_to_p(bad):
    with pytest.raises(ValueError, match="syncer.shards must be in 1..4"):
        shards.owners([1, 2, 3, 4], bad)


def test_spec_refuses_more_shards_than_fragments_and_the_assembly_splits_by_shard():
    from wan_diloco import spec
    from wan_diloco.assemble import Assembly
    from wan_diloco.config import ConfigError

    with pytest.raises(ConfigError, match=r"syncer.shards: must be at most learner.num_fragments \(4\)"):
        spec.from_document({"learner": {"num_fragments": 4}, "syncer": {"shards": 5}})
    with pytest.raises(ConfigError, match="syncer.shards"):
        spec.from_document({"syncer": {"shards": 0}})
    cfg = spec.from_document({"model": {"preset": "micro", "seq_len": 16}, "learner": {"num_fragments": 4}, "syncer": {"shards": 2}})
    parts = Assembly(cfg)
    cores = [parts.syncer_core(shard=s) for s in range(2)]
    assert sorted(p for c in cores for p in c.owned) == [0, 1, 2, 3]
    assert shards.imbalance(parts.layout.nbytes, parts.shard_plan) < 1.5
