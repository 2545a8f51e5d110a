"""One run file for every command: a file written for `simulate` launches unchanged, and the reverse."""
import json

import pytest

from wan_diloco import cli
from wan_diloco import spec as spec_lib
from wan_diloco.assemble import preflight
from wan_diloco.runtime.launch_prep import run_spec, write_config
from wan_diloco.spec import TOKEN_ENV

from .conftest import TOKEN, micro_config, micro_toml

# A file as one writes it for `simulate`: no token, no ports, a [simulate] table.
FOR_SIMULATE = micro_toml(run={"learners": 2, "steps": 16}, codec={"bits": 8},
                          simulate={"baseline": "decoupled", "step_time_s": 0.2, "bandwidth_gbit_s": 1.0,
                                    "speeds": [1.0, 1.3]})


def test_a_simulate_file_passes_what_launch_checks_and_writes_before_starting_processes(tmp_path, monkeypatch):
    """The fast half of the check below: everything `launch` does with the file before a process starts."""
    path = tmp_path / "sim.toml"
    path.write_text(FOR_SIMULATE)
    cfg = spec_lib.load(path)
    preflight(cfg)  # fragments fit, the corpus is there
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert cfg.token() == TOKEN  # no run.token in the file: the launcher passes the variable's
    child = run_spec(cfg, tmp_path / "run")
    write_config(tmp_path / "config.toml", child)
    read_back = spec_lib.load(tmp_path / "config.toml")  # what the syncer and learners read
    assert read_back == child and read_back.codec.bits == 8 and read_back.simulate == cfg.simulate
    assert read_back.run.min_learners_to_start == 2 and read_back.run.token == ""


@pytest.mark.slow  # ~70 s on 2 shared cores: a simulate and a real launch of 2 learners
def test_a_simulate_file_launches_unchanged(tmp_path, monkeypatch):
    path = tmp_path / "sim.toml"
    path.write_text(FOR_SIMULATE)
    assert cli.main(["simulate", "--config", str(path), "--quiet", "--json", str(tmp_path / "sim.json")]) == 0
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["config"]["codec"]["bits"] == 8 and sim["final_eval_loss"] < sim["initial_eval_loss"]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    summary = tmp_path / "launch.json"
    assert cli.main(["launch", "--config", str(path), "--quiet", "--run-dir", str(tmp_path / "run"),
                     "--json", str(summary)]) == 0
    got = json.loads(summary.read_text())
    assert got["learners_finished"] == 2 and got["bit_identical"]


def test_a_launch_file_simulates_unchanged(tmp_path):
    path = micro_config(tmp_path, learners=2, steps=16)  # the runtime tests' file: [transport], token, ports
    assert cli.main(["simulate", "--config", str(path), "--quiet", "--json", str(tmp_path / "sim.json")]) == 0
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["global_steps"] >= 16 and sim["config"]["transport"]["call_timeout_s"] == 10.0
    assert sim["final_eval_loss"] < sim["initial_eval_loss"]
