"""checkpoint.params: finding and reading the parameters a run starts from (``[model] init``)."""
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from wan_diloco.checkpoint import CheckpointError, load_params, params_file, read_init_params, save_params, tensor_specs
from wan_diloco.checkpoint.format import encode_state

T = {"a/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "b/scale": np.ones(3, np.float32)}
WANT = tensor_specs(T)


def test_a_file_a_run_wrote_and_a_plain_safetensors_file_read_alike(tmp_path):
    save_params(tmp_path / "ours.safetensors", T, {"run_id": "r"})
    save_file(T, str(tmp_path / "plain.safetensors"))  # written by another framework: no metadata of ours
    for name in ("ours", "plain"):
        got = read_init_params(tmp_path / f"{name}.safetensors", WANT)
        assert set(got) == set(T)
        for n in T:
            np.testing.assert_array_equal(got[n], T[n])


def test_a_corrupt_file_of_ours_is_refused_by_its_digest(tmp_path):
    data = bytearray(encode_state(T, {}, "params"))
    data[-1] ^= 0xFF  # the last byte of the last tensor
    (tmp_path / "p.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        read_init_params(tmp_path / "p.safetensors", WANT)


def write(tmp_path, tensors):
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("tensors, message", [
    ({"a/kernel": T["a/kernel"]}, "1 tensor of the model missing: 'b/scale' (another model, or other tensor names?)"),
    ({**T, "c/bias": np.zeros(2, np.float32)},
     "1 tensor the model does not have: 'c/bias' (another model, or other tensor names?)"),
    ({**T, "a/kernel": np.zeros((3, 2), np.float32)}, "tensor 'a/kernel' has shape (3, 2), the model wants (2, 3)"),
    ({**T, "b/scale": np.ones(3, np.float16)}, "tensor 'b/scale' is float16, the model wants float32"),
    ({**T, "b/scale": np.ones(3, ml_dtypes.bfloat16)}, "tensor 'b/scale' is bfloat16, the model wants float32"),
    ({**T, "b/scale": np.array([1, np.nan, np.inf], np.float32)},
     "non-finite values (NaN or inf) in 1 tensor: 'b/scale'"),
])
def test_each_mismatch_is_one_line_naming_the_tensor(tmp_path, tensors, message):
    path = write(tmp_path, tensors)
    with pytest.raises(CheckpointError) as e:
        read_init_params(path, WANT)
    assert str(e.value) == f"{path}: {message}"


def test_a_long_list_names_five_and_counts_the_rest(tmp_path):
    want = {f"layer_{i}/w": ((2,), "float32") for i in range(8)}
    path = write(tmp_path, {"other/w": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError) as e:
        read_init_params(path, want)
    text = str(e.value)
    assert "8 tensors of the model missing: 'layer_0/w', 'layer_1/w', 'layer_2/w', 'layer_3/w', 'layer_4/w' " \
           "and 3 more; 1 tensor the model does not have: 'other/w'" in text
    assert "\n" not in text


def test_a_folder_names_its_params_file(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    save_params(ckpt / "params.safetensors", T)
    assert params_file(tmp_path / "run") == (ckpt / "params.safetensors").resolve()  # a launched run's folder
    assert params_file(ckpt) == (ckpt / "params.safetensors").resolve()  # a checkpoint.dir
    assert params_file(ckpt / "params.safetensors") == (ckpt / "params.safetensors").resolve()
    # A run whose config put checkpoint.dir elsewhere: its config.toml says where.
    away = tmp_path / "elsewhere"
    save_params(away / "params.safetensors", T)
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "config.toml").write_text(f'[checkpoint]\ndir = "{away}"\n')
    assert params_file(tmp_path / "run2") == (away / "params.safetensors").resolve()


def test_a_folder_without_a_params_file_or_a_missing_path_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(tmp_path / 'nope'))}: no such file or folder$"):
        params_file(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"a folder with no parameter file \(looked for .*checkpoints/params"):
        params_file(tmp_path)
    save_params(tmp_path / "checkpoints" / "params.shard-0.safetensors", T)  # a sharded syncer's part, not joined
    with pytest.raises(CheckpointError, match="holds syncer shards' parts, not joined"):
        params_file(tmp_path)


def test_load_params_with_a_template_names_the_mismatch(tmp_path):
    save_params(tmp_path / "p.safetensors", T)
    like = {"a": {"kernel": T["a/kernel"]}, "b": {"scale": T["b/scale"]}}
    params = load_params(tmp_path / "p.safetensors", like=like)
    np.testing.assert_array_equal(params["a"]["kernel"], T["a/kernel"])
    with pytest.raises(CheckpointError, match=r"tensor 'a/kernel' has shape \(2, 3\), the model wants \(3, 2\)"):
        load_params(tmp_path / "p.safetensors", like={"a": {"kernel": np.zeros((3, 2))}, "b": {"scale": T["b/scale"]}})
    with pytest.raises(CheckpointError, match="1 tensor the model does not have: 'b/scale'"):
        load_params(tmp_path / "p.safetensors", like={"a": {"kernel": T["a/kernel"]}})
