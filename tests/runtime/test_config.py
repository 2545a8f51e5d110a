from pathlib import Path

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.runtime import config as rt

ROOT = Path(__file__).resolve().parents[2]


def test_default_is_examples_local_and_consistent():
    assert (ROOT / "examples" / "local.toml").read_text() == rt.DEFAULT_TOML
    cfg = rt.load(None)
    assert cfg.run.learners == cfg.syncer.num_learners == 4
    assert cfg.syncer.tau == cfg.learner.tau and cfg.train.total_steps == cfg.run.steps
    assert [cfg.run.region(m) for m in range(4)] == ["us-east", "eu-west", "us-east", "eu-west"]
    assert cfg.model.d_model == 128 and cfg.model.seq_len == 64  # tiny preset, shorter context


def test_two_region_example_parses():
    cfg = rt.load(ROOT / "examples" / "two_regions_tls.toml")
    assert cfg.transport.tls is not None and cfg.transport.tls.mutual


@pytest.mark.parametrize("doc, text", [
    ({"runn": {}}, "unknown table"),
    ({"run": {"learners": 3}, "syncer": {"num_learners": 4}}, "syncer.num_learners"),
    ({"model": {"preset": "huge"}}, "unknown preset"),
    ({"model": {"d_model": 30, "n_heads": 4}}, "model.n_heads"),
    ({"run": {"regions": []}}, "regions"),
    ({"transport": {"chunk_bytes": 10}}, "transport.chunk_bytes"),
])
def test_bad_configs_name_the_field(doc, text):
    with pytest.raises(ConfigError, match=text):
        rt.from_document(doc)


def test_token_from_config_or_environment(monkeypatch):
    monkeypatch.delenv(rt.TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="WAN_DILOCO_TOKEN"):
        rt.load(None).token()
    monkeypatch.setenv(rt.TOKEN_ENV, "from-env-123456")
    assert rt.load(None).token() == "from-env-123456"
