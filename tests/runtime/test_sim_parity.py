"""A real-process run and a simulated run of the same small config end at the same parameters.

Scope: one learner (``launch``: a syncer and a learner process on loopback) that blocks on each fragment's
update (``learner.blocking``, τ = 0), so every merge lands between the same two steps in both drivers
whatever the wall clock does, and a step budget (42) with no fragment due at the last step (a regular
upload still in flight at the end is merged by a real syncer, never delivered by the simulator, which stops
its clock there). One difference remains and is mirrored here, not hidden: the network learner draws one
batch to compile its step before it joins, so its first training batch is its data stream's second; the
simulated learner is given the same head start. With that, the final global parameters are bit-identical.
"""
import pytest

from wan_diloco import sim
from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import load_params
from wan_diloco.runtime.launch import launch

from .conftest import micro_config


@pytest.mark.slow  # two process start-ups and compiles: over a minute on two loaded cores
def test_one_blocking_learner_ends_at_the_same_parameters_real_and_simulated(tmp_path):
    path = micro_config(tmp_path, learners=1, steps=42, tau=0)
    path.write_text(path.read_text().replace("[learner]\n", "[learner]\nblocking = true\n"))
    spec = rt.load(path)
    code, summary = launch(spec, path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    real = load_params(tmp_path / "run" / "checkpoints" / "params.safetensors")

    s = sim.Simulation(sim.protocol_for(spec), Assembly(spec), [])
    s.learners[0].batches.next()  # the network learner's compile batch (see the module docstring)
    simulated = s.run().params
    assert real.keys() == simulated.keys()
    differ = [n for n in real if not (real[n] == simulated[n]).all()]
    assert not differ, f"{len(differ)} of {len(real)} tensors differ, e.g. {differ[:3]}"
