"""The Python API (wan_diloco/api.py, docs/api.md): the documented example as printed, the spec's errors, and
the CLI commands giving what the functions return."""
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import wan_diloco as wd
from tests.conftest import MICRO_TOML, micro_document, write_micro
from wan_diloco import cli
from wan_diloco.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_import_wan_diloco_loads_no_jax():
    code = ("import sys, wan_diloco as wd; assert 'jax' not in sys.modules, 'jax imported'; "
            "assert {'RunSpec', 'launch', 'simulate', 'plan', 'load_params'} <= set(dir(wd)); "
            "wd.RunSpec; assert 'jax' in sys.modules; print('ok')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    with pytest.raises(AttributeError, match="no attribute 'lanch'"):
        wd.lanch


def test_every_public_name_has_a_docstring():
    names = [n for n in wd.__all__ if n != "__version__"]
    assert {"RunSpec", "RunResult", "SimResult", "PlanResult", "launch", "simulate", "plan", "load_params",
            "read_params"} <= set(names)
    for name in names:
        assert (getattr(wd, name).__doc__ or "").strip(), name
    for member in (wd.RunSpec.load, wd.RunSpec.from_dict, wd.RunSpec.with_changes, wd.RunResult.ok,
                   wd.PlanResult.to_dict, wd.PlanResult.reached):
        assert (member.__doc__ or "").strip(), member


def test_runspec_load_and_from_dict_give_the_same_spec():
    loaded = wd.RunSpec.load(MICRO_TOML)
    assert loaded == wd.RunSpec.from_dict(micro_document()) == wd.RunSpec.load(str(MICRO_TOML))
    assert loaded.run.learners == 3 and loaded.preset == "micro"
    assert wd.RunSpec.from_dict({}).run.learners == 4  # every table optional: the defaults
    assert wd.RunSpec.load(None).run.steps == 300  # the embedded examples/local.toml


@pytest.mark.parametrize("doc, says", [
    ({"run": {"learners": 0}}, "run.learners: must be >= 1, got 0"),
    ({"run": {"lerners": 2}}, "run.lerners: unknown field"),
    ({"rnu": {}}, "rnu: unknown table"),
    ({"run": 3}, "run: must be a table"),
    ({"syncer": {"num_learners": 5}}, "syncer.num_learners: 5 differs from run.learners"),
])
def test_from_dict_refuses_a_bad_document_naming_the_key(doc, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        wd.RunSpec.from_dict(doc)


def test_load_refuses_a_missing_or_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        wd.RunSpec.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nsteps = -1\n")
    with pytest.raises(ConfigError, match="run.steps: must be >= 1"):
        wd.RunSpec.load(bad)


def test_the_functions_take_a_spec_a_path_or_a_dict_and_nothing_else(tmp_path):
    with pytest.raises(ConfigError, match="spec: must be a RunSpec, a TOML file's path or a dict of tables, got int"):
        wd.simulate(42)
    with pytest.raises(ConfigError, match="run.learners"):
        wd.plan({"run": {"learners": 0}}, step_time_s=0.1)
    # A missing corpus is refused before any process starts or any folder is made.
    with pytest.raises(ConfigError, match="corpus"):
        wd.launch(micro_document(data={"corpus": str(tmp_path / "none.txt")}), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_simulate_returns_what_the_cli_writes(tmp_path):
    config = write_micro(tmp_path / "micro.toml", run={"learners": 2, "steps": 8}, learner={"sync_every": 4})
    tape = tmp_path / "tape.json"
    tape.write_text(json.dumps([{"learner": 1, "down_at": 1.0, "up_at": 3.0}]))
    result = wd.simulate(config, failures=tape)
    assert result.final_eval_loss < result.initial_eval_loss and result.uptime == 1.0  # learner 0 stayed up
    assert result.global_steps >= 8 and result.bytes_sent > 0
    assert result.config["run"]["learners"] == 2 and set(result.params) == set(wd.load_params(_saved(tmp_path, result)))
    # The command prints and writes what the function returns (deterministic for a seed).
    out = tmp_path / "r.json"
    assert cli.main(["simulate", "--config", str(config), "--failures", str(tape), "--quiet", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert {k: v for k, v in written.items() if k != "wall_s"} == \
        {k: v for k, v in result.to_json().items() if k != "wall_s"}


def _saved(tmp_path, result) -> Path:
    from wan_diloco.checkpoint import save_params

    path = tmp_path / "sim.safetensors"
    save_params(path, result.params)
    return path


def test_plan_returns_what_the_cli_writes_and_the_spec_to_run(tmp_path):
    result = wd.plan(MICRO_TOML, step_time_s=0.05)
    plan = result.plan
    assert result.reached == plan.reached and result.step_time_from == "given" and plan.step_time_s == 0.05
    assert result.spec.learner.sync_every == plan.sync_every and result.spec.learner.tau == plan.tau
    assert result.spec.codec.bits == plan.bits and result.spec.learner.num_fragments == plan.fragments
    assert result.spec.run == wd.RunSpec.load(MICRO_TOML).run  # only the planned settings change
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--config", str(MICRO_TOML), "--step-time", "0.05", "--json", str(out)])
    assert code == (0 if plan.reached else 1)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result.to_dict(config=str(MICRO_TOML))))
    with pytest.raises(ConfigError, match="step_time: must be > 0"):
        wd.plan(MICRO_TOML, step_time_s=0)
    with pytest.raises(ConfigError, match="measured: .* not found"):
        wd.plan(MICRO_TOML, step_time_s=0.05, measured=tmp_path / "metrics.jsonl")


def test_a_launch_that_fails_returns_why(tmp_path):
    with socket.socket() as taken:  # the syncer's port, held by someone else: it cannot listen
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = wd.launch(micro_document(run={"learners": 2, "steps": 8, "port": port}), run_dir=tmp_path / "run")
    assert result.exit_code == 1 and not result.ok and result.params_path is None
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in result.error
    assert result.error == result.summary["error"] and result.run_dir == tmp_path / "run"
    assert result.learners == {} and result.initial_eval_loss is None and result.final_eval_loss is None
    assert "address already in use" in (tmp_path / "run" / "syncer.log").read_text()


def test_run_result_is_frozen_and_ok_follows_the_exit_code():
    result = wd.RunResult(exit_code=1, error="the syncer died", run_dir=None, params_path=None,
                          initial_eval_loss=None, final_eval_loss=None, learners={}, summary={})
    assert not result.ok and wd.RunResult(**{**dataclasses.asdict(result), "exit_code": 0}).ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.exit_code = 0


def example_code() -> str:
    """The one python block of docs/api.md, as printed."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (ROOT / "docs" / "api.md").read_text(), re.S | re.M)
    assert len(blocks) == 1, f"docs/api.md has {len(blocks)} python blocks; the test runs one"
    return blocks[0]


@pytest.mark.slow
def test_the_docs_example_runs_as_printed(tmp_path, monkeypatch, capsys):
    (tmp_path / "examples").mkdir()
    shutil.copy(MICRO_TOML, tmp_path / "examples" / "micro.toml")
    monkeypatch.chdir(tmp_path)  # the example runs from the repository root: examples/micro.toml, runs/
    scope: dict = {}
    exec(compile(example_code(), "docs/api.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "simulated: eval loss" in out and "launched: eval loss" in out and "plan: H = " in out
    result, params = scope["result"], scope["params"]
    assert result.ok and result.error is None and result.final_eval_loss < result.initial_eval_loss
    assert result.run_dir == Path("runs/api-example") and (result.run_dir / "metrics.jsonl").is_file()
    assert sorted(result.learners) == [0, 1] and all(f["final_eval_loss"] == result.final_eval_loss
                                                     for f in result.learners.values())
    assert set(params) == set(scope["sim"].params)  # the same model, whether simulated or launched
    assert scope["next_run"].learner.sync_every == scope["planned"].plan.sync_every
