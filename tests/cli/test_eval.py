"""`wan-diloco eval --params P`: a run's saved parameters evaluate to the loss the run reported."""
import dataclasses
import json

import pytest

from wan_diloco import load_params, spec
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import save_params
from wan_diloco.cli import main

from tests.conftest import micro_toml

CONFIG = micro_toml()


def test_eval_of_saved_parameters_matches_the_in_process_loss(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    parts = Assembly(spec.load(tmp_path / "run.toml"))
    save_params(tmp_path / "params.safetensors", parts.params0, {"run_id": "r"})
    assert main(["eval", "--params", str(tmp_path / "params.safetensors"), "--config", str(tmp_path / "run.toml")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval_loss"] == pytest.approx(parts.evaluate(parts.params0), rel=1e-6) and out["run_id"] == "r"
    tree = load_params(tmp_path / "params.safetensors", like=parts.params0)  # the package-level loader
    assert tree.keys() == parts.params0.keys()


def test_eval_of_a_damaged_file_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    (tmp_path / "params.safetensors").write_bytes(b"\x10" + bytes(20))
    assert main(["eval", "--params", str(tmp_path / "params.safetensors"), "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and len(err.strip().splitlines()) == 1


def test_eval_without_config_reads_the_run_config_beside_the_weights(tmp_path, capsys):
    """Case 11 of #23: RUN_DIR/checkpoints/params.safetensors is scored with RUN_DIR/config.toml, not the
    built-in default (whose model would not even fit these weights)."""
    (tmp_path / "config.toml").write_text(CONFIG)
    cfg = spec.load(tmp_path / "config.toml")
    parts = Assembly(cfg)
    (tmp_path / "checkpoints").mkdir()
    save_params(tmp_path / "checkpoints" / "params.safetensors", parts.params0,
                {"run_id": "r", "model": dataclasses.asdict(cfg.model)})
    assert main(["eval", "--params", str(tmp_path / "checkpoints" / "params.safetensors")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["config"] == str((tmp_path / "config.toml").resolve())
    assert out["eval_loss"] == pytest.approx(parts.evaluate(parts.params0), rel=1e-6)


def test_eval_without_config_and_no_run_folder_refuses_in_one_line(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    parts = Assembly(spec.load(tmp_path / "run.toml"))
    (tmp_path / "elsewhere").mkdir()
    save_params(tmp_path / "elsewhere" / "params.safetensors", parts.params0, {"run_id": "r"})
    assert main(["eval", "--params", str(tmp_path / "elsewhere" / "params.safetensors")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1
    assert "no run config beside" in cap.err and "--config" in cap.err


def test_eval_refuses_a_config_whose_model_is_not_the_files(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    cfg = spec.load(tmp_path / "run.toml")
    parts = Assembly(cfg)
    stored = {**dataclasses.asdict(cfg.model), "seq_len": 64}  # same shapes, another context length
    save_params(tmp_path / "params.safetensors", parts.params0, {"run_id": "r", "model": stored})
    assert main(["eval", "--params", str(tmp_path / "params.safetensors"), "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err
    assert "model.seq_len 64 in the file vs 32 in the config" in err and len(err.strip().splitlines()) == 1
