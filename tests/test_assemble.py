import numpy as np
import pytest

from wan_diloco import spec as spec_lib
from wan_diloco.assemble import Assembly, fragment_digest, preflight
from wan_diloco.config import ConfigError

from tests.conftest import write_micro


def micro(**kw):
    return spec_lib.from_short(preset="micro", learners=3, batch_size=2, eval_batches=1, **kw)


def test_every_process_builds_the_same_run():
    a, b = Assembly(micro(bits=8)), Assembly(micro(bits=8))
    assert a.layout.fragments == b.layout.fragments
    for names in a.layout.fragments:
        assert fragment_digest(a.flat0, names) == fragment_digest(b.flat0, names)
    enc = a.codec.roundtrip({n: a.flat0[n] for n in a.layout.fragments[0]})
    assert enc.nbytes < a.layout.nbytes[0] / 3  # [codec] bits = 8 is what goes on the wire
    bulk = a.bulk_codec.roundtrip({n: a.flat0[n] for n in a.layout.fragments[1]})
    for n, v in bulk.values.items():
        np.testing.assert_array_equal(v, a.flat0[n])  # whole fragments travel lossless


def test_learners_and_syncer_come_from_the_spec():
    s = micro()
    parts = Assembly(s)
    cores = [parts.learner_core(m) for m in range(3)]
    assert [c.region for c in cores] == [s.region(m) for m in range(3)]
    assert parts.syncer_core().cfg.num_learners == 3
    assert "state0" not in vars(parts)  # the syncer side builds no inner optimizer state
    assert [len(sh) > 0 for sh in parts.data_shards] == [True] * 3
    batch = parts.batches(1).next()
    assert batch.tokens.shape == (2, 33)


def test_too_many_fragments_is_a_config_error_that_says_how_many_fit():
    with pytest.raises(ConfigError, match=r"^learner.num_fragments: 64 leaves fragments .* empty .*; at most (\d+) fit") as e:
        Assembly(micro(fragments=64)).layout
    fits = int(e.value.args[0].rsplit("at most ", 1)[1].split()[0])
    assert len(Assembly(micro(fragments=fits)).layout.fragments) == fits  # the advice works
    with pytest.raises(ConfigError, match="at most"):
        Assembly(micro(fragments=fits + 1)).layout


def test_preflight_finds_what_would_stop_every_process_without_building_the_model(tmp_path):
    preflight(micro(fragments=2))  # fine: nothing raised
    with pytest.raises(ConfigError, match="^learner.num_fragments: 64"):
        preflight(micro(fragments=64))
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=f"^data.corpus: {missing}: no such file"):
        preflight(micro(corpus=str(missing)))
    preflight(micro(corpus=str(missing)), data=False)  # a syncer's host needs no corpus


def regional(tmp_path, eu_path):
    (tmp_path / "us.txt").write_bytes(bytes(range(32, 127)) * 400)
    path = write_micro(tmp_path / "run.toml", run={"batch_size": 2},
                       data={"corpus": str(tmp_path / "us.txt"), "regions": {"eu-west": str(eu_path)}})
    return spec_lib.load(path)


def test_each_region_reads_its_own_corpus_split_among_its_learners(tmp_path):
    (tmp_path / "eu.txt").write_bytes(b"eu " * 9000)
    spec = regional(tmp_path, tmp_path / "eu.txt")
    assert [spec.region(m) for m in range(3)] == ["us-east", "eu-west", "us-east"]
    us, eu = Assembly(spec, 0), Assembly(spec, 1)
    assert us.peers == [0, 2] and eu.peers == [1] and len(us.data_shards) == 2 and len(eu.data_shards) == 1
    assert set(np.unique(eu.corpus.train)) == set(b"eu ")  # learner 1 reads only its region's file
    assert ord("z") in set(np.unique(us.corpus.train))  # and the others data.corpus
    assert len(eu.batches(1).next().tokens) == 2 and set(np.unique(eu.batches(1).next().tokens)) <= set(b"eu ")
    assert Assembly(spec, 2).batches(2).next().tokens.max() >= ord("z")  # us-east text has letters past 'u'
    # The run's copy of the config keeps the table.
    again = spec_lib.from_document(spec_lib.to_document(spec))
    assert again.data.regions == (("eu-west", str(tmp_path / "eu.txt")),)


def test_a_region_whose_corpus_is_missing_is_named_before_any_process_starts(tmp_path):
    spec = regional(tmp_path, tmp_path / "nowhere.txt")
    with pytest.raises(ConfigError, match=r"data.regions.eu-west: .*nowhere.txt: no such file"):
        preflight(spec)
    preflight(spec, learner=0)  # a us-east host does not need the eu-west file
    with pytest.raises(ConfigError, match="data.regions.mars: no such region"):
        (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text().replace("eu-west =", "mars ="))
        spec_lib.load(tmp_path / "run.toml")


def test_the_mesh_may_be_given():
    """A multi-process learner builds its parts on the global mesh (runtime.multihost.global_mesh)."""
    import jax

    from wan_diloco.train import local_mesh

    mesh = local_mesh(jax.devices()[:1])
    parts = Assembly(micro(), 0, mesh=mesh)
    assert parts.mesh is mesh and parts.evaluate(parts.params0) > 0


def test_the_fingerprint_names_a_fragment_order_only_when_it_is_not_index_order():
    from wan_diloco.core import fingerprint as fingerprint_lib
    plain = Assembly(micro(fragments=4)).fingerprint
    assert plain == Assembly(micro(fragments=4, fragment_order=(0, 1, 2, 3))).fingerprint
    planned = Assembly(micro(fragments=4, fragment_order=(1, 0, 2, 3))).fingerprint
    assert fingerprint_lib.differences(plain, planned) == ["schedule (learner.fragment_order 1-0-2-3 vs missing)"]


def test_the_fingerprint_names_eager_learners_and_their_stand_in_lr_only_when_on():
    from wan_diloco.core import fingerprint as fingerprint_lib
    plain = Assembly(micro()).fingerprint
    assert plain == Assembly(micro(eager=False, staleness="scale")).fingerprint  # the syncer's alone: not compared
    eager = Assembly(micro(eager=True, outer_lr=0.5)).fingerprint
    assert fingerprint_lib.differences(plain, eager) == ["schedule (learner.eager 1 vs missing, syncer.outer.lr 0.5 vs missing)"]
    assert Assembly(micro(eager=True)).learner_core(0).outer_lr == np.float32(micro().syncer.outer.lr)


def test_the_fingerprint_names_the_direct_stripes_port_only_when_one_is_set():
    from wan_diloco.core import fingerprint as fingerprint_lib
    plain = Assembly(micro()).fingerprint
    direct = Assembly(micro().with_changes(transport={"direct_port": 7701})).fingerprint
    assert fingerprint_lib.differences(direct, plain) == ["transport (transport.direct_port missing vs 7701)"]
