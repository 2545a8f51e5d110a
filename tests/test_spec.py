from pathlib import Path

import pytest

from wan_diloco import spec as rt
from wan_diloco.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_default_is_examples_local_and_consistent():
    assert (ROOT / "examples" / "local.toml").read_text() == rt.DEFAULT_TOML
    cfg = rt.load(None)
    assert cfg.run.learners == cfg.syncer.num_learners == 4
    assert cfg.syncer.tau == cfg.learner.tau and cfg.train.total_steps == cfg.run.steps
    assert [cfg.region(m) for m in range(4)] == ["us-east", "eu-west", "us-east", "eu-west"]
    assert cfg.model.d_model == 128 and cfg.model.seq_len == 64  # tiny preset, shorter context


def test_two_region_example_parses():
    cfg = rt.load(ROOT / "examples" / "two_regions_tls.toml")
    assert cfg.transport.tls is not None and cfg.transport.tls.mutual


@pytest.mark.parametrize("doc, text", [
    ({"runn": {}}, "unknown table"),
    ({"run": {"learners": 3}, "syncer": {"num_learners": 4}}, "syncer.num_learners"),
    ({"learner": {"tau": 2}, "syncer": {"tau": 1}}, "syncer.tau"),
    ({"model": {"vocab_size": 512}, "data": {"vocab_size": 256}}, "data.vocab_size"),
    ({"train": {"total_steps": 7}}, "train.total_steps"),
    ({"simulate": {"baseline": "sync"}}, "simulate.baseline"),
    ({"run": {"learners": 2}, "simulate": {"speeds": [1.0]}}, "simulate.speeds"),
    ({"data": {"corpus": ""}}, "data.corpus"),
    ({"train": {"warmup_steps": "10"}}, "train.warmup_steps"),
    ({"codec": {"bits": 8, "stochastic_rounding": True}}, "codec.stochastic_rounding"),
    ({"run": {"corpus": "stdlib"}}, "run.corpus: unknown field"),
    ({"model": {"preset": "huge"}}, "unknown preset"),
    ({"model": {"d_model": 30, "n_heads": 4}}, "model.n_heads"),
    ({"regions": {"names": []}}, "regions.names"),
    ({"run": {"regions": ["a"]}}, "run.regions: unknown field"),
    ({"run": {"learners": 2}, "regions": {"learners": ["us-east"]}}, "regions.learners"),
    ({"transport": {"chunk_bytes": 10}}, "transport.chunk_bytes"),
    ({"learner": {"hosts": 0}}, "learner.hosts: must be a whole number >= 1"),
    ({"learner": {"hosts": 1.5}}, "learner.hosts"),
    ({"run": {"batch_size": 6}, "learner": {"hosts": 4}}, "run.batch_size: 6 does not split over the learner's 4"),
    ({"run": {"devices": [0]}, "learner": {"hosts": 2}}, "run.devices: not with learner.hosts = 2"),
    ({"run": {"devices_per_learner": 3}, "learner": {"hosts": 2}}, "run.devices_per_learner: 3 GPUs do not split"),
])
def test_bad_configs_name_the_field(doc, text):
    with pytest.raises(ConfigError, match=text):
        rt.from_document(doc)


# The token follows the TLS files' rule (host_tls): the environment over the run file; an empty variable is unset.
@pytest.mark.parametrize("env, file, token", [
    ("from-env-123456", "", "from-env-123456"),
    (None, "from-file-123456", "from-file-123456"),
    ("", "from-file-123456", "from-file-123456"),
    ("from-env-123456", "from-file-123456", "from-env-123456"),
])
def test_token_from_the_environment_over_the_run_file(monkeypatch, env, file, token):
    if env is None:
        monkeypatch.delenv(rt.TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(rt.TOKEN_ENV, env)
    assert rt.from_document({"run": {"token": file}}).token() == token


@pytest.mark.parametrize("env, file, error", [
    (None, "", "^WAN_DILOCO_TOKEN: not set and no run.token in the run file"),
    ("short", "from-file-123456", "^WAN_DILOCO_TOKEN: must be"),  # the variable wins even when it is wrong
    (None, "tiny", "^run.token: must be"),
])
def test_a_missing_or_short_token_names_its_source(monkeypatch, env, file, error):
    if env is None:
        monkeypatch.delenv(rt.TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(rt.TOKEN_ENV, env)
    with pytest.raises(ConfigError, match=error):
        rt.from_document({"run": {"token": file}}).token()


def test_one_default_per_setting():
    s = rt.from_document({})
    assert s.syncer.num_learners == s.run.learners and s.syncer.tau == s.learner.tau
    assert s.data.vocab_size == s.model.vocab_size and s.train.total_steps == s.run.steps
    assert s.train.warmup_steps <= s.train.total_steps // 10  # a short run is not all warmup
    assert s.codec.bits == 32 and s.syncer.outer.lr == 0.4


def test_document_round_trip():
    s = rt.load(ROOT / "examples" / "two_regions_tls.toml")
    assert rt.from_document(rt.to_document(s)) == s
    t = s.with_changes(run={"learners": 2}, learner={"tau": 3})
    assert t.syncer.num_learners == 2 and t.syncer.tau == 3 and t.regions == s.regions
    with pytest.raises(ConfigError, match="unknown table"):
        s.with_changes(runn={})


def test_token_budget_sets_the_schedule():
    s = rt.from_document({"run": {"batch_size": 2, "learners": 4}, "model": {"seq_len": 64},
                          "simulate": {"tokens": 2 * 64 * 4 * 100}})
    assert s.train.total_steps == 100 and s.train.warmup_steps == 10


def test_dumps_round_trips_through_toml_and_leaves_unset_values_out():
    import tomllib

    s = rt.load(None).with_changes(regions={"links": {"eu-west": {"rtt_ms": 90.0}}},
                                     transport={"tls": {"ca_file": "ca.pem"}}, plan={"adapt_tau": True})
    text = rt.dumps(s)
    assert "max_grace_s" not in text  # None: unset, and TOML has no null
    assert rt.from_document(tomllib.loads(text)) == s


@pytest.mark.parametrize("doc, text", [
    ({"run": {"eval_every": 10}}, "run.eval_every: renamed; write run.eval_every_steps instead"),
    ({"simulate": {"eval_every": 10}}, "simulate.eval_every: renamed; write simulate.curve_every_steps instead"),
    ({"simulate": {"shard_merge_gb_s": 0.5}}, r"simulate.shard_merge_gb_s: renamed; write plan.shard_merge_gb_s "
                                               r"\(the one merge rate\) with simulate.merge_takes_time = true"),
])
def test_an_old_key_names_its_new_name(doc, text):
    with pytest.raises(ConfigError, match=text):
        rt.from_document(doc)


def test_renamed_keys_load_and_each_default_is_declared_once():
    s = rt.from_document({"run": {"eval_every_steps": 10}, "simulate": {"curve_every_steps": 5, "merge_takes_time": True},
                          "plan": {"shard_merge_gb_s": 0.5}})
    assert (s.run.eval_every_steps, s.simulate.curve_every_steps, s.plan.shard_merge_gb_s) == (10, 5, 0.5)
    d = rt.from_document({})
    assert (d.run.eval_every_steps, d.simulate.curve_every_steps, d.simulate.merge_takes_time) == (0, 50, False)
    assert not hasattr(d.simulate, "shard_merge_gb_s")  # one merge rate: plan.shard_merge_gb_s


@pytest.mark.parametrize("order, text", [
    ([0, 1, 2], "learner.fragment_order: must list each of the 4 fragments"),
    ([0, 1, 1, 3], "learner.fragment_order: fragment 1 is listed 2 times"),
    ([0, 1, 2, 4], "learner.fragment_order: entries must be fragment indices 0..3"),
    ([0, 1, 2, "3"], r"learner.fragment_order\[3\]: must be an integer"),
])
def test_fragment_order_is_a_permutation_of_the_fragments(order, text):
    with pytest.raises(ConfigError, match=text):
        rt.from_document({"learner": {"num_fragments": 4, "fragment_order": order}})


def test_fragment_order_defaults_to_index_order_and_round_trips():
    assert rt.from_document({}).learner.fragment_order == ()
    s = rt.from_document({"learner": {"num_fragments": 4, "fragment_order": [1, 0, 2, 3]}})
    assert s.learner.fragment_order == (1, 0, 2, 3)
    assert rt.from_document(rt.to_document(s)) == s


@pytest.mark.parametrize("call, says", [
    (lambda: rt.from_document({"run": {"step": 10}}),
     r"^run\.step: unknown field; known fields are .*did you mean `steps`\?$"),
    (lambda: rt.from_document({"modle": {}}), r"^modle: unknown table; .*did you mean `model`\?$"),
    (lambda: rt.from_short(learner=2), r"^learner: unknown setting; known: .*did you mean `learners`\?$"),
    (lambda: rt.from_document({"run": {"qqqqqq": 1}}), r"^run\.qqqqqq: unknown field; known fields are [a-z_, ]*$"),
])
def test_unknown_keys_name_the_near_miss(call, says):
    with pytest.raises(ConfigError, match=says):
        call()
