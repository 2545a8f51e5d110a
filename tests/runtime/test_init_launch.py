"""``[model] init`` through `launch`: real processes (a syncer, two learners) start from a previous run's
folder, refuse nothing, and end bit-identical."""
import numpy as np
import pytest

from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import save_params
from wan_diloco.runtime.launch import launch

from .conftest import micro_config


@pytest.mark.slow  # a syncer and two learners as processes: about a minute on 2 shared cores
def test_a_launch_from_a_previous_runs_folder_starts_every_process_there(tmp_path):
    seeded = Assembly(rt.load(micro_config(tmp_path, learners=2)))  # the same run without init
    rng = np.random.default_rng(7)
    start = {n: rng.normal(0, 0.05, a.shape).astype(np.float32) for n, a in seeded.flat0.items()}
    save_params(tmp_path / "prev" / "checkpoints" / "params.safetensors", start)
    path = micro_config(tmp_path, learners=2, steps=24, model={"init": str(tmp_path / "prev")})
    spec = rt.load(path)
    code, summary = launch(spec, path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    assert summary["bit_identical"] and summary["learners_finished"] == 2
    # The learners' first eval is the file's parameters' loss: they trained from there, not from the seed.
    parts = Assembly(spec)
    assert summary["initial_eval_loss"] == pytest.approx(parts.evaluate(parts.params0), rel=1e-5)
    assert summary["initial_eval_loss"] != pytest.approx(seeded.evaluate(seeded.params0), rel=1e-3)
