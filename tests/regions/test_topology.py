"""The [regions] table: defaults, per-region overrides, learner placement, errors that name the field."""
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.regions.topology import LinkConfig, RegionsConfig, regions_from_mapping


def test_defaults_are_stated_once():
    cfg = regions_from_mapping({})
    assert cfg == RegionsConfig()
    assert cfg.syncer_region == cfg.names[0]
    assert cfg.remote == cfg.names[1:]
    assert cfg.link_of(cfg.names[1]) == LinkConfig()
    assert (LinkConfig().rate_gbit_s, LinkConfig().rtt_ms, LinkConfig().jitter_ms, LinkConfig().loss_pct) == (
        2.0, 60.0, 0.0, 0.0)


def test_per_region_links_merge_onto_the_default_link():
    cfg = regions_from_mapping({
        "names": ["us-east", "eu-west", "ap-south"], "syncer": "eu-west",
        "link": {"rate_gbit_s": 5, "rtt_ms": 40},
        "links": {"ap-south": {"rtt_ms": 150, "loss_pct": 0.5}},
    })
    assert cfg.syncer_region == "eu-west"
    assert cfg.remote == ("us-east", "ap-south")
    assert cfg.link_of("us-east") == LinkConfig(rate_gbit_s=5.0, rtt_ms=40.0)
    assert cfg.link_of("ap-south") == LinkConfig(rate_gbit_s=5.0, rtt_ms=150.0, loss_pct=0.5)
    assert cfg.link_of("ap-south").one_way_s == pytest.approx(0.075)
    with pytest.raises(KeyError, match="syncer's region"):
        cfg.link_of("eu-west")
    with pytest.raises(KeyError, match="unknown region"):
        cfg.link_of("mars")


def test_learners_round_robin_by_default_or_as_listed():
    cfg = regions_from_mapping({"names": ["a", "b", "c"]})
    assert [cfg.region_of(m) for m in range(5)] == ["a", "b", "c", "a", "b"]
    listed = regions_from_mapping({"names": ["a", "b"], "learners": ["b", "b", "a"]})
    assert [listed.region_of(m) for m in range(3)] == ["b", "b", "a"]
    with pytest.raises(ConfigError, match="learners"):
        listed.region_of(3)


@pytest.mark.parametrize("table, field", [
    ({"names": ["a", "b"], "links": {"b": {"rate_gbit_s": 0}}}, "regions.links.b.rate_gbit_s: must be > 0"),
    ({"link": {"rate_gbit_s": -1}}, "regions.link.rate_gbit_s: must be > 0"),
    ({"link": {"rtt_ms": -1}}, "regions.link.rtt_ms: must be >= 0"),
    ({"link": {"rtt_ms": 10, "jitter_ms": 6}}, "regions.link.jitter_ms"),
    ({"link": {"loss_pct": 100}}, "regions.link.loss_pct"),
    ({"link": {"rate_gbit_s": "fast"}}, "regions.link.rate_gbit_s: must be a number"),
    ({"names": []}, "regions.names: need at least one region"),
    ({"names": ["a", "a"]}, "regions.names: must not repeat"),
    ({"names": ["Bad Name"]}, "regions.names[0]"),
    ({"names": ["-x"]}, "regions.names[0]"),
    ({"names": ["a"], "syncer": "b"}, "regions.syncer"),
    ({"names": ["a", "b"], "learners": ["a", "c"]}, "regions.learners[1]"),
    ({"congestion_control": "cubic; rm -rf"}, "regions.congestion_control"),
    ({"names": ["a", "b"], "links": {"c": {}}}, "regions.links.c"),
    ({"names": ["a", "b"], "links": {"a": {}}}, "regions.links.a: the syncer's region"),
    ({"names": ["a", "b"], "links": {"b": {"speed": 1}}}, "regions.links.b.speed: unknown field"),
    ({"names": ["a", "b"], "links": {"b": 3}}, "regions.links.b: must be a table"),
    ({"colour": "red"}, "regions.colour: unknown field"),
])
def test_errors_name_the_field(table, field):
    with pytest.raises(ConfigError) as e:
        regions_from_mapping(table)
    assert str(e.value).startswith(field), str(e.value)


def test_emulator_without_root_says_so(monkeypatch):
    from wan_diloco.regions import emulator

    monkeypatch.setattr(emulator.os, "geteuid", lambda: 1000)
    with pytest.raises(emulator.EmulatorError, match="needs root"):
        with emulator.Emulator(RegionsConfig(), prefix="wdlz"):
            pass


def test_emulator_refuses_a_long_prefix():
    from wan_diloco.regions.emulator import Emulator, EmulatorError

    with pytest.raises(EmulatorError, match="prefix"):
        Emulator(RegionsConfig(), prefix="much-too-long")


def test_cli_wan_up_reads_the_regions_table(tmp_path, capsys):
    from wan_diloco.cli import main

    bad = tmp_path / "run.toml"
    bad.write_text("[regions]\nnames = ['a', 'b']\n[regions.links.b]\nrate_gbit_s = 0\n")
    with pytest.raises(SystemExit) as e:
        main(["wan", "up", "--config", str(bad)])
    assert e.value.code == 2
    assert "regions.links.b.rate_gbit_s: must be > 0" in capsys.readouterr().err
    none = tmp_path / "none.toml"
    none.write_text("[run]\n")
    with pytest.raises(SystemExit):
        main(["wan", "up", "--config", str(none)])
    assert "no [regions] table" in capsys.readouterr().err
