"""Which devices a learner trains on: `run.devices` (`learner --devices`), and the platform `launch` gives
each process (`run.platform`, `run.devices_per_learner`)."""
import json
import subprocess
import sys
import textwrap

import pytest

from wan_diloco import spec
from wan_diloco.config import ConfigError
from wan_diloco.runtime.launch import Cluster

from tests.conftest import write_micro


def load(tmp_path, extra=""):
    write_micro(tmp_path / "run.toml", "[run]\n" + extra, model={"seq_len": 16})
    return spec.load(tmp_path / "run.toml")


@pytest.mark.slow  # a fresh JAX process with two host devices: ~20 s
def test_a_learner_trains_on_the_devices_it_is_given(tmp_path):
    # Two host devices stand in for two GPUs: the mesh holds the chosen one only, and a step runs on it.
    load(tmp_path, "devices = [1]\n")
    code = textwrap.dedent(f"""
        import json, jax
        from wan_diloco import spec
        from wan_diloco.assemble import Assembly
        from wan_diloco.config import ConfigError
        parts = Assembly(spec.load({str(tmp_path / "run.toml")!r}))
        state, metrics = parts.step_fn(parts.state0, parts.batches(0).next().tokens)
        out = {{"mesh": [str(d) for d in parts.mesh.devices.flat], "n": len(jax.local_devices()),
               "on": sorted(str(d) for d in jax.tree_util.tree_leaves(state.params)[0].devices())}}
        try:
            Assembly(spec.load({str(tmp_path / "run.toml")!r}).with_changes(run={{"devices": [5]}})).mesh
        except ConfigError as e:
            out["error"] = str(e)
        print(json.dumps(out))
    """)
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["n"] == 2 and out["mesh"] == ["cpu:1"] and out["on"] == ["cpu:1"]
    assert "run.devices: [5], but this process has 2 devices" in out["error"]


@pytest.mark.parametrize("extra, message", [
    ("devices = [0, 0]\n", "run.devices: must be distinct"),
    ('platform = "tpu"\n', "run.platform: must be one of 'cpu', 'gpu', 'auto', got 'tpu'"),
    ("devices_per_learner = -1\n", "run.devices_per_learner: must be >= 0"),
])
def test_bad_device_settings_are_named(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, extra)


def test_launch_gives_each_learner_its_platform_and_gpus_and_the_syncer_the_cpu(tmp_path):
    def env_of(extra, name):
        cfg = load(tmp_path, extra)
        return Cluster(cfg, tmp_path / "run.toml", tmp_path, token="t" * 16)._env_of(name)

    assert env_of("", "learner-1")["JAX_PLATFORMS"] == "cpu"
    gpu = 'platform = "gpu"\ndevices_per_learner = 2\n'
    assert env_of(gpu, "learner-2")["JAX_PLATFORMS"] == "cuda" and env_of(gpu, "learner-2")["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env_of(gpu, "syncer")["JAX_PLATFORMS"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in env_of(gpu, "syncer")
    assert "JAX_PLATFORMS" not in env_of('platform = "auto"\n', "learner-0")
