"""``[model] init``: a run starts from a parameter file's Θ(0) in every learner, the syncer and the simulator."""
import math
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from wan_diloco import sim
from wan_diloco import spec as spec_lib
from wan_diloco import tree
from wan_diloco.assemble import Assembly, preflight
from wan_diloco.checkpoint import save_params
from wan_diloco.config import ConfigError
from wan_diloco.core.messages import ProtocolError

BASE = dict(preset="micro", learners=2, batch_size=2, eval_batches=1, fragments=2)


def micro(**kw):
    return spec_lib.from_short(**{**BASE, **kw})


@pytest.fixture(scope="module")
def random0():
    """Θ(0) of the micro model from the seed: the names and shapes a file must have."""
    return Assembly(micro()).flat0


def other(flat, seed=1):
    """Parameters of the same shapes as ``flat`` that no seed gives."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.05, a.shape).astype(np.float32) for n, a in flat.items()}


def with_init(path, **kw):
    return micro(**kw).with_changes(model={"init": str(path)})


def test_every_learner_and_the_syncer_start_from_the_files_parameters(tmp_path, random0):
    want = other(random0)
    save_params(tmp_path / "w.safetensors", want)
    parts = Assembly(with_init(tmp_path / "w.safetensors"))
    learners = [parts.learner_core(m) for m in range(2)]
    held = [{n: a for frag in core.base for n, a in frag.items()} for core in learners]
    for flat in [parts.syncer_core().global_params(), tree.flatten(parts.state0.params), *held]:
        assert set(flat) == set(want)
        for n in want:
            np.testing.assert_array_equal(np.asarray(flat[n]), want[n])
    assert not np.array_equal(want["lm_head/kernel"], random0["lm_head/kernel"])  # not the seed's


def test_a_plain_safetensors_file_with_the_models_names_works(tmp_path, random0):
    want = other(random0, seed=2)
    save_file(want, str(tmp_path / "hub.safetensors"))  # no metadata of ours: written by another framework
    got = Assembly(with_init(tmp_path / "hub.safetensors")).flat0
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])


def test_a_previous_runs_folder_names_its_parameters(tmp_path, random0):
    want = other(random0, seed=3)
    save_params(tmp_path / "prev" / "checkpoints" / "params.safetensors", want)
    spec = with_init(tmp_path / "prev")
    assert spec.model.init == str((tmp_path / "prev" / "checkpoints" / "params.safetensors").resolve())
    np.testing.assert_array_equal(Assembly(spec).flat0["embed/embedding"], want["embed/embedding"])
    # The resolved config a launch writes for its processes reads back to the same file.
    assert spec_lib.from_document(spec_lib.to_document(spec)).model.init == spec.model.init


def test_a_missing_file_is_refused_when_the_config_loads(tmp_path):
    with pytest.raises(ConfigError, match=f"^model.init: {re.escape(str(tmp_path / 'gone.safetensors'))}: "
                                          f"no such file or folder$"):
        with_init(tmp_path / "gone.safetensors")
    with pytest.raises(ConfigError, match=r"^model.init: .*: a folder with no parameter file"):
        with_init(tmp_path)


def mangled(random0, name):
    flat = dict(random0)
    k = "block_0/attn/qkv/kernel"
    if name == "missing":
        del flat[k]
    elif name == "extra":
        flat["block_9/attn/qkv/kernel"] = flat[k]
    elif name == "shape":
        flat[k] = flat[k][:, :64]
    elif name == "dtype":
        flat[k] = flat[k].astype(np.float16)
    elif name == "nan":
        flat[k] = flat[k].copy()
        flat[k][0, 0] = np.nan
    return flat


@pytest.mark.parametrize("case, message", [
    ("missing", "1 tensor of the model missing: 'block_0/attn/qkv/kernel' (another model, or other tensor names?)"),
    ("extra", "1 tensor the model does not have: 'block_9/attn/qkv/kernel' (another model, or other tensor names?)"),
    ("shape", "tensor 'block_0/attn/qkv/kernel' has shape (32, 64), the model wants (32, 96)"),
    ("dtype", "tensor 'block_0/attn/qkv/kernel' is float16, the model wants float32"),
    ("nan", "non-finite values (NaN or inf) in 1 tensor: 'block_0/attn/qkv/kernel'"),
])
def test_a_file_that_is_not_the_models_parameters_is_one_line_naming_model_init(tmp_path, random0, case, message):
    path = tmp_path / f"{case}.safetensors"
    save_file(mangled(random0, case), str(path))
    spec = with_init(path)
    want = f"model.init: {path}: {message}"
    with pytest.raises(ConfigError) as e:
        preflight(spec, data=False)  # before any process of a launch starts
    assert str(e.value) == want
    parts = Assembly(spec)
    with pytest.raises(ConfigError) as e:
        parts.flat0
    assert str(e.value) == want
    assert "params0" not in vars(parts) and "flat0" not in vars(parts)  # nothing half-built is kept


def test_the_fingerprint_carries_the_start_so_a_learner_from_another_file_is_refused(tmp_path, random0):
    save_params(tmp_path / "a.safetensors", other(random0, seed=4))
    save_params(tmp_path / "b.safetensors", other(random0, seed=5))
    save_params(tmp_path / "a-copy.safetensors", other(random0, seed=4))
    a, b = Assembly(with_init(tmp_path / "a.safetensors")), Assembly(with_init(tmp_path / "b.safetensors"))
    plain = Assembly(micro())
    assert a.fingerprint == Assembly(with_init(tmp_path / "a-copy.safetensors")).fingerprint  # same Θ(0), same
    assert a.fingerprint != b.fingerprint
    assert "model=" not in plain.fingerprint  # a run without init keeps its fingerprint
    syncer = a.syncer_core()
    syncer.start("run", a.fingerprint)
    syncer.check_settings(0, a.fingerprint)  # the same start: accepted
    with pytest.raises(ProtocolError, match=rf"learner 1: .*starting parameters \(model.init {b.init_digest} vs "
                                            rf"{a.init_digest}\)"):
        syncer.check_settings(1, b.fingerprint)
    with pytest.raises(ProtocolError, match=r"starting parameters \(model.init missing vs #"):
        syncer.check_settings(0, plain.fingerprint)


def test_the_simulator_starts_from_the_file(tmp_path, random0):
    # All-zero parameters give all-zero logits: a uniform prediction, whose loss is exactly ln(vocab). The
    # seed's start is off it by about 0.03 nats on micro, far past the tolerance.
    save_params(tmp_path / "zero.safetensors", {n: np.zeros_like(a) for n, a in random0.items()})
    result = sim.run(with_init(tmp_path / "zero.safetensors", steps=4, sync_every=4))
    assert result.initial_eval_loss == pytest.approx(math.log(256), abs=1e-5)
    assert result.global_steps >= 4
