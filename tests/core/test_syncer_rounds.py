"""The staleness-aware merge weights of a round (``merge.Accumulator``'s gains, ``SyncerRounds._fold``)."""
import numpy as np
import pytest

from wan_diloco.core import SyncerConfig, SyncerCore
from wan_diloco.merge import Accumulator
from wan_diloco.outer import OuterConfig

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload


def make(**outer):
    cfg = SyncerConfig(num_learners=3, tau=2, quorum=1, grace=False, merge="mean",
                       outer=OuterConfig(**{"lr": 1.0, "momentum": 0.0, **outer}))
    return SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC)


def merged(ups, gains=None, rda=False):
    acc = Accumulator([(3,)], [rda])
    for i, u in enumerate(ups):
        acc.add([u.delta["block_0/w"]], u.c_tokens ** 2 / u.c_steps, None, *([] if gains is None else [gains[i]]))
    return acc.result()[0]


@pytest.mark.parametrize("rda", [False, True])
def test_gained_merge_is_the_weighted_sum_over_the_ungained_weights(rda):
    rng = np.random.default_rng(0)
    ups = [upload(m, delta=rng.normal(size=3).astype(np.float32), c_steps=8, c_tokens=800 + 100 * m) for m in range(3)]
    gains = np.array([1.0, 0.5, 0.25])
    got = merged(ups, gains, rda)
    w = np.array([u.c_tokens ** 2 / u.c_steps for u in ups])
    d = [u.delta["block_0/w"].astype(np.float64) for u in ups]
    if rda:  # norm Σ w·g·‖Δ‖ / Σ w along the direction of Σ (w·g/‖Δ‖)·Δ
        direction = sum(wi * g * x / np.linalg.norm(x) for wi, g, x in zip(w, gains, d))
        want = sum(wi * g * np.linalg.norm(x) for wi, g, x in zip(w, gains, d)) / w.sum() * direction / np.linalg.norm(direction)
    else:
        want = sum(wi * g * x for wi, g, x in zip(w, gains, d)) / w.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(merged(ups, np.ones(3), rda), merged(ups, None, rda))


def test_a_gain_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="gains"):
        Accumulator([(3,)], [False]).add([np.ones(3, np.float32)], 1.0, None, 1.5)


def rounds(s, late_base=0):
    """Round 8 merges learner 0; learner 1's Δ of round 8 comes late and is carried into round 16 with
    learner 0's next Δ (based on version 1): in round 16 it is one version stale when ``late_base`` is 0."""
    s.on_fragment(1.0, upload(0, due=8, delta=np.full(3, 0.2, np.float32)))
    s.on_fragment(1.5, upload(1, due=8, delta=np.full(3, 0.4, np.float32), base_version=late_base))
    s.on_fragment(2.0, upload(0, due=16, delta=np.full(3, -0.1, np.float32), base_version=1))
    return s.theta[0]["block_0/w"]


@pytest.mark.parametrize("outer", [dict(staleness="scale"), dict(staleness="gate", momentum=0.5),
                                   dict(staleness="scale", staleness_power=3.0)])
def test_fresh_deltas_merge_to_the_same_bits_as_without_the_option(outer):
    # The late Δ here is based on version 1: it is fresh when round 16 merges, so nothing is scaled.
    base = {k: v for k, v in outer.items() if k == "momentum"}
    np.testing.assert_array_equal(rounds(make(**outer), late_base=1), rounds(make(**base), late_base=1))


def test_a_stale_delta_is_scaled_by_its_staleness():
    plain, scaled = rounds(make()), rounds(make(staleness="scale", staleness_power=1.0))
    after_8 = PARAMS["block_0/w"] - 0.2
    # Equal weights; learner 1's Δ is 1 version stale: gain 1/2, and the merge divides by the ungained sum.
    np.testing.assert_allclose(plain, after_8 - (0.4 - 0.1) / 2, rtol=1e-6)
    np.testing.assert_allclose(scaled, after_8 - (0.5 * 0.4 - 0.1) / 2, rtol=1e-6)
