"""A user's own flax module (not a preset) trained through `launch`, and through `simulate`: the run ends
bit-identical, its saved parameters are the module's and evaluate to the loss the run reported."""
import json
from pathlib import Path

import pytest

from wan_diloco import cli, load_params
from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.runtime.launch import launch

from .conftest import micro_config

USER = Path(__file__).parents[1] / "fixtures" / "user_model.py"


def with_user_model(path: Path) -> Path:
    path.write_text(path.read_text().replace("[model]\n", f'[model]\nmodule = "{USER}:make"\n'))
    return path


def test_launch_trains_a_user_module_and_keeps_it(tmp_path):
    path = with_user_model(micro_config(tmp_path, learners=2, steps=40, min_step_s=0.05))
    code, summary = launch(rt.load(path), path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    assert summary["bit_identical"] and summary["learners_finished"] == 2
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3
    params = load_params(summary["params_path"])
    assert "mix/kernel" in params and "layers_1/kernel" in params  # the user's module, not the transformer
    # The file evaluates to the loss the run reported, through `wan-diloco eval` with the run's config.
    cfg_file = tmp_path / "run" / "config.toml"
    assert f'{USER}:make' in cfg_file.read_text()
    parts = Assembly(rt.load(cfg_file))
    like = load_params(summary["params_path"], like=parts.params0)
    assert parts.evaluate(like) == pytest.approx(summary["final_eval_loss"], rel=1e-5)


def test_simulate_trains_a_user_module(tmp_path, capsys):
    path = with_user_model(micro_config(tmp_path, learners=2, steps=24))
    out, params = tmp_path / "r.json", tmp_path / "params.safetensors"
    assert cli.main(["simulate", "--config", str(path), "--quiet", "--json", str(out), "--params-out", str(params)]) == 0
    result = json.loads(out.read_text())
    assert result["final_eval_loss"] < result["initial_eval_loss"] - 0.3
    assert result["config"]["model"]["module"] == f"{USER}:make"
    assert "mix/kernel" in load_params(params)
