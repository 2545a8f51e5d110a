import numpy as np
import pytest

from wan_diloco.config import ConfigError, from_mapping
from wan_diloco.outer import OuterConfig, OuterOptimizer


def test_nesterov_matches_hand_computation():
    theta = {"w": np.array([1.0, -2.0], np.float32)}
    opt = OuterOptimizer(OuterConfig(lr=0.5, momentum=0.9), {0: theta})
    delta = {"w": np.array([0.2, 0.4], np.float32)}
    new = opt.step(0, theta, delta)
    # optax nesterov: m = g; update = -lr * (g + mu * m)
    np.testing.assert_allclose(new["w"], theta["w"] - 0.5 * (1 + 0.9) * delta["w"], rtol=1e-6)
    newer = opt.step(0, new, delta)
    m2 = 0.9 * delta["w"] + delta["w"]
    np.testing.assert_allclose(newer["w"], new["w"] - 0.5 * (delta["w"] + 0.9 * m2), rtol=1e-6)


def test_fragments_have_independent_momentum():
    frags = {0: {"a": np.zeros(2, np.float32)}, 1: {"b": np.zeros(2, np.float32)}}
    opt = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.9, nesterov=False), frags)
    opt.step(0, frags[0], {"a": np.ones(2, np.float32)})
    out = opt.step(1, frags[1], {"b": np.ones(2, np.float32)})
    np.testing.assert_allclose(out["b"], -1.0)  # no momentum leaked from fragment 0


def test_lr_one_no_momentum_is_plain_averaging():
    theta = {"w": np.array([1.0], np.float32)}
    opt = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.0), {0: theta})
    np.testing.assert_allclose(opt.step(0, theta, {"w": np.array([0.25], np.float32)})["w"], 0.75)


def test_bad_config():
    with pytest.raises(ConfigError, match="momentum"):
        from_mapping(OuterConfig, {"momentum": 1.0})


@pytest.mark.parametrize("cfg", [OuterConfig(lr=0.4, momentum=0.6), OuterConfig(lr=0.7, momentum=0.9, nesterov=False),
                                 OuterConfig(lr=0.5, momentum=0.0)])
def test_numpy_step_matches_optax_over_several_steps(cfg):
    import jax
    import optax

    from wan_diloco.merge import CHUNK, Workers
    from wan_diloco.outer import make_outer_optimizer

    rng = np.random.default_rng(0)
    theta = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=CHUNK + 7).astype(np.float32)}
    opt = OuterOptimizer(cfg, {0: theta})
    tx = make_outer_optimizer(cfg)
    ref_theta, ref_state = dict(theta), tx.init(theta)
    ours = dict(theta)
    for k in range(4):
        delta = {n: (rng.normal(size=a.shape) * 0.1).astype(np.float32) for n, a in theta.items()}
        updates, ref_state = tx.update(delta, ref_state, ref_theta)
        ref_theta = optax.apply_updates(ref_theta, updates)
        ours = opt.step(0, ours, delta) if k % 2 else _update_commit(opt, ours, delta, Workers(2))
        for n in theta:  # the same float32 operations: equal up to XLA's own fusions (1 ulp)
            np.testing.assert_array_max_ulp(ours[n], np.asarray(ref_theta[n]), maxulp=1)
    # The state keeps optax's pytree, so snapshots keep their tensor names.
    from wan_diloco import tree
    assert tree.to_named(opt.states[0], "outer/0").keys() == tree.to_named(ref_state, "outer/0").keys()
    for n, a in tree.to_named(ref_state, "outer/0").items():
        np.testing.assert_array_max_ulp(tree.to_named(opt.states[0], "outer/0")[n], a, maxulp=1)
    assert jax.tree.structure(opt.states[0]) == jax.tree.structure(jax.tree.map(np.asarray, ref_state))


def _update_commit(opt, params, delta, workers):
    u = opt.update(0, delta, workers)
    opt.commit(0, delta, workers)
    return {n: params[n] + u[n] for n in params}


def test_update_leaves_the_momentum_until_commit():
    theta = {"w": np.zeros(4, np.float32)}
    opt = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.5), {0: theta})
    before = np.array(opt.states[0][0].trace["w"])
    opt.update(0, {"w": np.ones(4, np.float32)})
    np.testing.assert_array_equal(opt.states[0][0].trace["w"], before)
    opt.commit(0, {"w": np.ones(4, np.float32)})
    np.testing.assert_array_equal(opt.states[0][0].trace["w"], 1.0)


def test_set_state_copies_a_read_only_snapshot_state():
    theta = {"w": np.zeros(2, np.float32)}
    opt = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.5), {0: theta})
    frozen = np.array([1.0, 2.0], np.float32)
    frozen.flags.writeable = False
    opt.set_state(0, (opt.states[0][0]._replace(trace={"w": frozen}), opt.states[0][1]))
    opt.commit(0, {"w": np.ones(2, np.float32)})  # writes into its own copy
    np.testing.assert_array_equal(opt.states[0][0].trace["w"], [1.5, 2.0])
    np.testing.assert_array_equal(frozen, [1.0, 2.0])


@pytest.mark.parametrize("table, text", [
    ({"lr": 1e300}, r"syncer\.outer\.lr: must be a number in \(0, 10\], got 1e\+300"),
    ({"lr": 0.0}, r"syncer\.outer\.lr"),
    ({"lr": -0.4}, r"syncer\.outer\.lr"),
    ({"momentum": 1.0}, r"syncer\.outer\.momentum: must be in \[0, 1\)"),
    ({"momentum": -0.1}, r"syncer\.outer\.momentum"),
])
def test_an_outer_setting_out_of_its_sane_range_is_refused_at_load_naming_the_key(table, text):
    from wan_diloco import spec

    with pytest.raises(ConfigError, match=text):
        spec.from_document({"syncer": {"outer": table}})
    assert spec.from_document({"syncer": {"outer": {"lr": 10.0, "momentum": 0.99}}}).syncer.outer.lr == 10.0


# ---- staleness-aware outer steps (docs/method.md, "Staleness-aware outer steps") ----------------

def test_staleness_gains_match_the_formulas():
    from wan_diloco.outer import staleness_gains

    s = [0, 1, 3, 0, 2]
    cos = [0.9, -0.5, -1.0, -1.0, 0.3]
    scale = staleness_gains(OuterConfig(staleness="scale", staleness_power=0.7), s)
    np.testing.assert_array_equal(scale, [1.0, 2.0 ** -0.7, 4.0 ** -0.7, 1.0, 3.0 ** -0.7])
    gate = staleness_gains(OuterConfig(staleness="gate", staleness_power=2.0), s, cos)
    # Fresh Δs and stale ones that agree with the momentum keep their weight; disagreeing stale ones
    # lose it in proportion to how far they point against it.
    np.testing.assert_allclose(gate, [1.0, 2.0 ** (-2.0 * 0.5), 4.0 ** -2.0, 1.0, 1.0], rtol=1e-15)


@pytest.mark.parametrize("cfg, s", [(OuterConfig(), [0, 3]), (OuterConfig(staleness="scale"), [0, 0]),
                                    (OuterConfig(staleness="gate"), [0, 0, 0])])
def test_no_option_or_no_stale_delta_leaves_the_merge_alone(cfg, s):
    from wan_diloco.outer import staleness_gains

    assert staleness_gains(cfg, s, [-1.0] * len(s)) is None


def test_gate_cosine_is_against_the_fragments_momentum():
    from wan_diloco.outer import cosine

    rng = np.random.default_rng(1)
    theta = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}
    opt = OuterOptimizer(OuterConfig(staleness="gate", staleness_power=1.0), {0: theta})
    first = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in theta.items()}
    opt.commit(0, first)  # the momentum is now ``first``
    against = {n: -a for n, a in first.items()}
    flat = np.concatenate([first[n].ravel() for n in theta]).astype(np.float64)
    other = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in theta.items()}
    oflat = np.concatenate([other[n].ravel() for n in theta]).astype(np.float64)
    assert cosine(other, first) == pytest.approx(oflat @ flat / np.linalg.norm(oflat) / np.linalg.norm(flat), rel=1e-12)
    gains = opt.gains(0, [0, 1, 1], [against, against, first])
    np.testing.assert_allclose(gains, [1.0, 0.5, 1.0], rtol=1e-12)


@pytest.mark.parametrize("doc, key", [({"staleness": "lag"}, "staleness"), ({"staleness_power": 0}, "staleness_power"),
                                      ({"staleness_power": 9.0}, "staleness_power"),
                                      ({"staleness": "gate", "momentum": 0.0}, "staleness")])
def test_bad_staleness_settings_name_the_key(doc, key):
    with pytest.raises(ConfigError, match=key):
        from_mapping(OuterConfig, doc)
