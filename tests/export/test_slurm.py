"""sbatch scripts: valid bash, only real sbatch options with valid values, and run (with a fake srun that
starts each task as Slurm would) they start the right learner per task with its own credentials."""
import re
import subprocess

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.export import ExportOptions, export

from .helpers import credentials, parse, run_file

# sbatch long options the scripts may use, and what a valid value looks like (sbatch(1))
SBATCH = {
    "job-name": r"[A-Za-z0-9._-]+",
    "nodes": r"[1-9]\d*",
    "ntasks": r"[1-9]\d*",
    "ntasks-per-node": r"[1-9]\d*",
    "gpus-per-task": r"[1-9]\d*",
    "exclusive": None,
    "time": r"(\d+-)?\d+(:\d{2}){0,2}",
    "output": r"[A-Za-z0-9._%-]+",
    "nodelist": r"[A-Za-z0-9.,\[\]-]+",
}


def files(options=ExportOptions(), **tables):
    spec, text = run_file(**tables)
    return export(spec, text, "slurm", options)


def sbatch_options(script: str) -> dict:
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    opts = {}
    for line in lines[1:]:
        if not line.startswith("#SBATCH"):
            break  # sbatch reads #SBATCH lines only before the first command
        m = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(\S+))?", line)
        assert m, f"not one long option: {line!r}"
        name, value = m.groups()
        assert name in SBATCH, f"unknown sbatch option --{name}"
        pattern = SBATCH[name]
        assert (value is None) if pattern is None else re.fullmatch(pattern, value or ""), line
        opts[name] = value
    assert not any(line.startswith("#SBATCH") for line in lines[len(opts) + 1:]), "an #SBATCH after a command"
    return opts


def test_every_script_is_valid_bash_with_known_sbatch_options():
    out = files(ExportOptions(syncer_hosts=("node17",), time="2-00:00:00"), run={"platform": "gpu",
                                                                                "devices_per_learner": 4})
    assert sorted(out) == ["launch.sh", "region-eu-west-1.sbatch", "region-us-east-1.sbatch", "run.toml",
                           "syncer.sbatch"]
    for name, text in out.items():
        if name != "run.toml":
            subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    east = sbatch_options(out["region-us-east-1.sbatch"])
    assert east == {"job-name": "wd-us-east-1", "nodes": "3", "ntasks": "3", "ntasks-per-node": "1",
                    "time": "2-00:00:00", "output": "wd-us-east-1-%j.out", "gpus-per-task": "4"}
    syncer = sbatch_options(out["syncer.sbatch"])
    assert syncer["nodelist"] == "node17" and syncer["nodes"] == "1" and "gpus-per-task" not in syncer


def test_all_gpus_of_a_node_is_the_node_to_itself():
    assert "exclusive" in sbatch_options(files(run={"platform": "gpu"})["region-us-east-1.sbatch"])
    assert "exclusive" not in sbatch_options(files()["region-us-east-1.sbatch"])


def test_each_task_runs_its_regions_learner_with_its_own_credentials(fakes, parser, tmp_path):
    out = files()
    credentials(tmp_path, 5)
    for region, ids in (("us-east-1", [0, 2, 4]), ("eu-west-1", [1, 3])):
        calls = fakes(out[f"region-{region}.sbatch"], SLURM_SUBMIT_DIR=str(tmp_path), FAKE_NTASKS=str(len(ids)),
                      SYNCER="node3:7070")
        assert len(calls) == len(ids)
        for call, m in zip(calls, ids):
            args = parse(parser, call["argv"])
            assert (args.command, args.id, args.syncer, args.config) == ("learner", m, "node3:7070",
                                                                        f"{tmp_path}/run.toml")
            assert call["env"]["WAN_DILOCO_TOKEN"] == f"learner-{m}-token"
            assert call["env"]["WAN_DILOCO_TLS_CERT"] == f"{tmp_path}/tls/learner-{m}.pem"
    [call] = fakes(out["syncer.sbatch"], SLURM_SUBMIT_DIR=str(tmp_path))
    args = parse(parser, call["argv"])
    assert (args.command, args.port) == ("syncer", 7070) and call["env"]["WAN_DILOCO_TOKEN"] == "run-token-0123"
    assert call["env"]["WAN_DILOCO_TLS_KEY"] == f"{tmp_path}/tls/syncer.key"


def test_a_region_without_the_syncers_address_stops_at_once(tmp_path):
    script = tmp_path / "r.sbatch"
    script.write_text(files()["region-eu-west-1.sbatch"])
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "SYNCER: set SYNCER to the HOST:PORT of each syncer shard" in proc.stderr


def test_shards_each_get_a_script_and_a_given_host_is_the_default(fakes, parser, tmp_path):
    out = files(ExportOptions(syncer_hosts=("n1", "n2")), syncer={"shards": 2})
    assert {"syncer-0.sbatch", "syncer-1.sbatch"} <= set(out)
    credentials(tmp_path, 5)
    for s in range(2):
        assert sbatch_options(out[f"syncer-{s}.sbatch"])["nodelist"] == f"n{s + 1}"
        [call] = fakes(out[f"syncer-{s}.sbatch"], SLURM_SUBMIT_DIR=str(tmp_path))
        assert parse(parser, call["argv"]).shard == s
    [call, _] = fakes(out["region-eu-west-1.sbatch"], SLURM_SUBMIT_DIR=str(tmp_path), FAKE_NTASKS="2")
    assert parse(parser, call["argv"]).syncer == "n1:7070,n2:7070"


def test_without_a_syncer_host_the_run_file_must_expect_the_certificates_name():
    with pytest.raises(ConfigError, match=r"transport.tls.server_name: .* add server_name = \"wd-syncer\""):
        files(transport={"tls": {}})


def test_launch_script_submits_the_syncer_then_each_region_with_its_node(fakes):
    calls = fakes(files(syncer={"shards": 2})["launch.sh"])
    tools = [(c["argv"], c["env"].get("SYNCER")) for c in calls if c["argv"][0] in ("sbatch", "squeue")]
    assert tools == [
        (["sbatch", "--parsable", "syncer-0.sbatch"], None), (["sbatch", "--parsable", "syncer-1.sbatch"], None),
        (["squeue", "-h", "-j", "job-syncer-0", "-t", "R", "-o", "%N"], None),
        (["squeue", "-h", "-j", "job-syncer-1", "-t", "R", "-o", "%N"], None),
        (["sbatch", "region-us-east-1.sbatch"], "node-job-syncer-0:7070,node-job-syncer-1:7070"),
        (["sbatch", "region-eu-west-1.sbatch"], "node-job-syncer-0:7070,node-job-syncer-1:7070")]
