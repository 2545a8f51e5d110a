import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from wan_diloco import data as d
from wan_diloco import train as tr
from wan_diloco.config import ConfigError, from_mapping
from wan_diloco.tree import flatten

from tests.conftest import micro_model

MICRO = micro_model(seq_len=16)
TRAIN = tr.TrainConfig(lr=1e-2, warmup_steps=5, total_steps=100)


@pytest.fixture(scope="module")
def state0():
    return tr.init_state(MICRO, TRAIN, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return d.load_corpus(d.DataConfig(max_bytes=400_000)).train


def test_loss_falls(tokens, state0):
    mesh = tr.local_mesh()
    state = state0
    step = tr.make_train_step(MICRO, TRAIN, mesh)
    evaluate = tr.make_eval_fn(MICRO, mesh)
    held = d.eval_batches(tokens, 8, MICRO.seq_len, 2)
    before = evaluate(state.params, held)
    it = d.batches(tokens, 8, MICRO.seq_len, seed=0)
    losses = []
    for _ in range(30):
        state, metrics = step(state, next(it).tokens)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert int(state.step) == 30
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    assert evaluate(state.params, held) < before - 1.0


def test_set_params_keeps_opt_state_and_step(state0):
    state = state0
    other = jax.tree_util.tree_map(lambda x: x + 1, state.params)
    new = tr.set_params(state, other)
    assert new.params is other and new.opt_state is state.opt_state and new.step is state.step


def test_schedule_step_moves_the_learning_rate_only(tokens, state0):
    step = tr.make_train_step(MICRO, TRAIN, tr.local_mesh())
    batch = next(d.batches(tokens, 8, MICRO.seq_len, seed=0)).tokens
    sched = tr.lr_schedule(TRAIN)
    early, m0 = step(state0, batch)  # lr(0) = 0 at the start of the warmup: nothing moves
    late, m1 = step(tr.set_schedule_step(state0, 60), batch)
    assert float(m0["lr"]) == 0.0 and float(m1["lr"]) == pytest.approx(float(sched(60)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(early.params),
                                                    jax.tree_util.tree_leaves(state0.params)))
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(late.params),
                                                        jax.tree_util.tree_leaves(state0.params)))
    # The schedule moved on from 60; the local step and Adam's bias-correction count did not jump.
    assert int(tr.schedule_step(late)) == 61 and int(tr.schedule_step(early)) == 1
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    [adam] = [x for x in jax.tree_util.tree_leaves(late.opt_state, is_leaf=is_adam) if is_adam(x)]
    assert int(late.step) == 1 and int(adam.count) == 1


def test_weight_decay_skips_norm_scales(state0):
    tx = tr.make_optimizer(tr.TrainConfig(warmup_steps=0, total_steps=10))
    zeros = jax.tree_util.tree_map(np.zeros_like, state0.params)
    # With zero gradients only weight decay moves parameters.
    updates, _ = jax.jit(tx.update)(zeros, tx.init(state0.params), state0.params)
    flat = flatten(updates)
    assert np.all(np.asarray(flat["final_norm/scale"]) == 0)
    assert np.any(np.asarray(flat["block_0/attn/qkv/kernel"]) != 0)


def test_bad_batch_shape(state0):
    step = tr.make_train_step(MICRO, TRAIN, tr.local_mesh())
    with pytest.raises(ConfigError, match="seq_len"):
        step(state0, np.zeros((2, MICRO.seq_len + 2), np.int32))


@pytest.mark.parametrize("bad,field", [({"total_steps": 10, "warmup_steps": 10}, "total_steps"),
                                       ({"lr": 0.0}, "lr"), ({"b2": 1.0}, "b2")])
def test_config_validation(bad, field):
    with pytest.raises(ConfigError, match=field):
        from_mapping(tr.TrainConfig, bad)


_MULTI_DEVICE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from wan_diloco import data as d, train as tr
    from wan_diloco.config import ConfigError
    import dataclasses
    from wan_diloco.model import preset
    cfg = dataclasses.replace(preset("micro"), seq_len=16)
    tc = tr.TrainConfig(lr=1e-2, warmup_steps=2, total_steps=100)
    assert len(jax.devices()) == 4, jax.devices()
    toks = d.load_corpus(d.DataConfig(max_bytes=200_000)).train
    batches = [b.tokens for _, b in zip(range(4), d.batches(toks, 8, 16, seed=1))]
    held = d.eval_batches(toks, 8, 16, 2)
    out = {}
    for n in (1, 4):
        mesh = tr.local_mesh(jax.devices()[:n])
        state = tr.init_state(cfg, tc, jax.random.key(0))
        step = tr.make_train_step(cfg, tc, mesh)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        out[n] = {"losses": losses, "eval": tr.make_eval_fn(cfg, mesh)(state.params, held),
                  "n_shards": len(state.params["embed"]["embedding"].sharding.device_set)}
    try:
        step(state, batches[0][:6])
        out["error"] = None
    except ConfigError as e:
        out["error"] = str(e)
    print(json.dumps(out))
""")


def test_four_devices_match_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MULTI_DEVICE], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, four = out["1"], out["4"]
    assert four["n_shards"] == 4 and one["n_shards"] == 1
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(four["eval"], one["eval"], rtol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    assert "batch_size: 6 is not divisible by the 4 devices" in out["error"]


def test_step_functions_shared_and_donation(tokens):
    mesh = tr.local_mesh()
    assert tr.make_train_step(MICRO, TRAIN, mesh) is tr.make_train_step(MICRO, TRAIN, tr.local_mesh())
    assert tr.make_eval_fn(MICRO, mesh) is tr.make_eval_fn(MICRO, mesh)
    batch = next(d.batches(tokens, 8, MICRO.seq_len, seed=3)).tokens
    state = tr.init_state(MICRO, TRAIN, jax.random.key(0))
    kept, _ = tr.make_train_step(MICRO, TRAIN, mesh)(state, batch)
    assert np.isfinite(np.asarray(state.params["lm_head"]["kernel"])).all()  # not donated: still readable
    donated, _ = tr.make_train_step(MICRO, TRAIN, mesh, donate=True)(state, batch)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(kept),
                                                   jax.tree_util.tree_leaves(donated)))
    assert state.params["lm_head"]["kernel"].is_deleted()
