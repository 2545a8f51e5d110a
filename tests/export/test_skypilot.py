"""SkyPilot task YAML: read back by SkyPilot's own task loader, and each task's run script run in bash."""
import subprocess

import pytest
import yaml

from wan_diloco.config import ConfigError
from wan_diloco.export import ExportOptions, export

from .helpers import credentials, parse, run_file

OPTIONS = ExportOptions(cloud="aws")


def files(options=OPTIONS, **tables):
    spec, text = run_file(**tables)
    return export(spec, text, "skypilot", options)


def test_one_task_per_region_with_its_learners_and_one_for_the_syncer():
    out = files()
    assert sorted(out) == ["launch.sh", "region-eu-west-1.yaml", "region-us-east-1.yaml", "run.toml", "syncer.yaml"]
    east = yaml.safe_load(out["region-us-east-1.yaml"])
    assert east["num_nodes"] == 3 and east["resources"] == {"cloud": "aws", "region": "us-east-1"}
    assert east["envs"] == {"SYNCER": None}  # SkyPilot refuses to launch it without --env SYNCER=...
    mounts = east["file_mounts"]
    assert mounts["~/wan-diloco/run.toml"] == "run.toml"
    assert mounts["~/wan-diloco/tls/learner-4.key"] == "tls/learner-4.key"
    assert not any("learner-1" in src or src in ("token", "tls/ca.key") for src in mounts.values())  # not theirs
    syncer = yaml.safe_load(out["syncer.yaml"])
    assert syncer["num_nodes"] == 1 and syncer["resources"]["region"] == "us-east-1"
    assert syncer["resources"]["ports"] == [7070, 7071]  # learners and the dashboard reach it through the firewall
    assert "token" in syncer["file_mounts"].values()


def test_each_node_runs_its_own_learner_with_its_own_credentials(fakes, parser, tmp_path):
    out = files()
    home = tmp_path / "home"
    credentials(home / "wan-diloco", 5)
    for region, ids in (("us-east-1", [0, 2, 4]), ("eu-west-1", [1, 3])):
        script = yaml.safe_load(out[f"region-{region}.yaml"])["run"]
        for rank, m in enumerate(ids):
            [call] = fakes(script, HOME=str(home), SKYPILOT_NODE_RANK=str(rank), SYNCER="10.0.0.5:7070")
            args = parse(parser, call["argv"])
            assert (args.command, args.id, args.syncer) == ("learner", m, "10.0.0.5:7070")
            assert args.config == f"{home}/wan-diloco/run.toml"
            assert call["env"]["WAN_DILOCO_TOKEN"] == f"learner-{m}-token"
            assert call["env"]["WAN_DILOCO_TLS_CERT"] == f"{home}/wan-diloco/tls/learner-{m}.pem"
            assert call["env"]["WAN_DILOCO_TLS_KEY"] == f"{home}/wan-diloco/tls/learner-{m}.key"
            assert call["env"]["WAN_DILOCO_TLS_CA"] == f"{home}/wan-diloco/tls/ca.pem"
    [call] = fakes(yaml.safe_load(out["syncer.yaml"])["run"], HOME=str(home))
    args = parse(parser, call["argv"])
    assert (args.command, args.port) == ("syncer", 7070) and call["env"]["WAN_DILOCO_TOKEN"] == "run-token-0123"


def test_shards_each_get_a_task_and_learners_name_them_all(fakes, parser, tmp_path):
    out = files(syncer={"shards": 2})
    assert {"syncer-0.yaml", "syncer-1.yaml"} <= set(out)
    home = tmp_path / "home"
    credentials(home / "wan-diloco", 5)
    for s in range(2):
        [call] = fakes(yaml.safe_load(out[f"syncer-{s}.yaml"])["run"], HOME=str(home))
        assert parse(parser, call["argv"]).shard == s
    assert 'SYNCER="$(sky status --ip wd-syncer-0):7070,$(sky status --ip wd-syncer-1):7070"' in out["launch.sh"]


def test_a_given_syncer_host_is_the_default_address_and_the_certificate_name():
    out = files(ExportOptions(cloud="gcp", syncer_hosts=("syncer.example.com",), image="ghcr.io/me/wd:1"),
                transport={"tls": {}})
    east = yaml.safe_load(out["region-us-east-1.yaml"])
    assert east["envs"] == {"SYNCER": "syncer.example.com:7070"}
    assert east["resources"]["image_id"] == "docker:ghcr.io/me/wd:1" and "setup" not in east
    assert "--syncer-host syncer.example.com" in out["launch.sh"]


def test_launch_script_is_valid_bash_in_the_right_order():
    script = files()["launch.sh"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "--syncer-host wd-syncer" in script  # the name the run file's server_name expects
    order = [script.index(s) for s in ("wan-diloco certs", "sky launch -y -d -c wd-syncer syncer.yaml",
                                       "sky status --ip wd-syncer", "region-us-east-1.yaml --env SYNCER")]
    assert order == sorted(order)


def test_gpu_learners_take_the_accelerators_given():
    east = yaml.safe_load(files(ExportOptions(cloud="aws", accelerators="H100:8"),
                                run={"platform": "gpu"})["region-us-east-1.yaml"])
    assert east["resources"]["accelerators"] == "H100:8"
    syncer = yaml.safe_load(files(ExportOptions(cloud="aws", accelerators="H100:8"))["syncer.yaml"])
    assert "accelerators" not in syncer["resources"]  # the syncer merges on CPUs


@pytest.mark.parametrize("options, tables, needle", [
    (ExportOptions(), {}, "--cloud: required for skypilot"),
    (OPTIONS, {"run": {"platform": "gpu"}}, '--accelerators: run.platform is "gpu"'),
    (OPTIONS, {"transport": {"tls": {}}}, 'add server_name = "wd-syncer" under [transport.tls]'),
])
def test_what_skypilot_cannot_guess_is_asked_for(options, tables, needle):
    with pytest.raises(ConfigError) as e:
        files(options, **tables)
    assert needle in str(e.value)


def test_skypilots_own_loader_reads_every_task():
    sky = pytest.importorskip("sky", reason="SkyPilot is not installed: it is in the [export-check] "
                              "extra, not [test] (its click pin conflicts with W&B's); docs/launchers.md")
    out = files(ExportOptions(cloud="aws", accelerators="H100:8"), run={"platform": "gpu"}, syncer={"shards": 2})
    for name, text in out.items():
        if not name.endswith(".yaml"):
            continue
        doc = yaml.safe_load(text)
        task = sky.Task.from_yaml_config(doc, env_overrides=[("SYNCER", "10.0.0.5:7070,10.0.0.6:7070")])
        [res] = list(task.resources)
        assert (str(res.cloud).lower(), res.region) == ("aws", "us-east-1" if "east" in name or "syncer" in name
                                                         else "eu-west-1")
        assert task.num_nodes == (1 if name.startswith("syncer") else 3 if "east" in name else 2)
        assert task.file_mounts == {k: v for k, v in yaml.safe_load(text)["file_mounts"].items()}
        if name.startswith("region"):
            assert res.accelerators == {"H100": 8} and task.envs["SYNCER"] == "10.0.0.5:7070,10.0.0.6:7070"
    # and it does refuse what is not a task: the check can fail
    bad = yaml.safe_load(out["region-us-east-1.yaml"])
    bad["resources"]["regoin"] = bad["resources"].pop("region")
    with pytest.raises(Exception, match="regoin"):
        sky.Task.from_yaml_config(bad, env_overrides=[("SYNCER", "x:1")])


def test_launch_script_starts_the_syncers_then_the_regions_with_every_shards_ip(fakes):
    calls = fakes(files(syncer={"shards": 2})["launch.sh"])
    tools = [c["argv"] for c in calls if c["argv"][0] != "wan-diloco"]
    assert tools == [
        ["sky", "launch", "-y", "-d", "-c", "wd-syncer-0", "syncer-0.yaml"],
        ["sky", "launch", "-y", "-d", "-c", "wd-syncer-1", "syncer-1.yaml"],
        ["sky", "status", "--ip", "wd-syncer-0"], ["sky", "status", "--ip", "wd-syncer-1"],
        ["sky", "launch", "-y", "-d", "-c", "wd-us-east-1", "region-us-east-1.yaml", "--env",
         "SYNCER=ip-wd-syncer-0:7070,ip-wd-syncer-1:7070"],
        ["sky", "launch", "-y", "-d", "-c", "wd-eu-west-1", "region-eu-west-1.yaml", "--env",
         "SYNCER=ip-wd-syncer-0:7070,ip-wd-syncer-1:7070"]]
    made = [c["argv"][1] for c in calls if c["argv"][0] == "wan-diloco"]
    assert made == ["token"] * 5 + ["certs"]  # before any launch: the tasks mount what these write


def test_the_direct_stripes_port_goes_through_the_firewall_too():
    syncer = yaml.safe_load(files(transport={"direct_port": 7072})["syncer.yaml"])
    assert syncer["resources"]["ports"] == [7070, 7072, 7071]
