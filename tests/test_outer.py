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
