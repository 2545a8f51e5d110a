"""`wan-diloco eval --params P`: a run's saved parameters evaluate to the loss the run reported."""
import json

import pytest

from wan_diloco import load_params, spec
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import save_params
from wan_diloco.cli import main

CONFIG = """\
[run]
eval_batches = 1
eval_batch_size = 4

[data]
max_bytes = 262144

[model]
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 64
seq_len = 32
"""


def test_eval_of_saved_parameters_matches_the_in_process_loss(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    parts = Assembly(spec.load(tmp_path / "run.toml"))
    save_params(tmp_path / "params.safetensors", parts.params0, {"run_id": "r"})
    assert main(["eval", "--params", str(tmp_path / "params.safetensors"), "--config", str(tmp_path / "run.toml")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval_loss"] == pytest.approx(parts.evaluate(parts.params0), rel=1e-6) and out["run_id"] == "r"
    tree, _ = load_params(tmp_path / "params.safetensors", like=parts.params0)  # the package-level loader
    assert tree.keys() == parts.params0.keys()


def test_eval_of_a_damaged_file_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(CONFIG)
    (tmp_path / "params.safetensors").write_bytes(b"\x10" + bytes(20))
    assert main(["eval", "--params", str(tmp_path / "params.safetensors"), "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and len(err.strip().splitlines()) == 1
