"""One run file for every command: a file written for `simulate` launches unchanged, and the reverse."""
import json

from wan_diloco import cli
from wan_diloco.spec import TOKEN_ENV

from .conftest import TOKEN, micro_config, micro_toml

# A file as one writes it for `simulate`: no token, no ports, a [simulate] table.
FOR_SIMULATE = micro_toml(run={"learners": 2, "steps": 16}, codec={"bits": 8},
                          simulate={"baseline": "decoupled", "step_time_s": 0.2, "bandwidth_gbit_s": 1.0,
                                    "speeds": [1.0, 1.3]})


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
