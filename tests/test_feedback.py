"""Error feedback: the running sum of sent updates tracks the running sum of true ones."""
import numpy as np
import pytest

from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.feedback import ErrorFeedback
from wan_diloco.fragments import Layout

CODEC = FragmentCodec(CodecConfig(bits=4, block_size=32, impl="jnp"), Layout([("w", "b")], {"w": (4, 32), "b": (7,)}))


def roundtrip(values):
    """(decoded values, bytes): what a receiver gets."""
    enc = CODEC.roundtrip(values)
    return enc.values, enc.nbytes


def _deltas(rounds, seed=0):
    """Outer-gradient-like deltas: one large value per block hides the small ones."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        w = rng.standard_normal((4, 32)).astype(np.float32) * 0.01 + 0.002
        w[:, 0] = 1.0  # sets every block's scale; the rest sit far below half a level
        yield {"w": w, "b": rng.standard_normal(7).astype(np.float32)}


def _run(ef: ErrorFeedback, rounds=40):
    true_sum = {"w": 0.0, "b": 0.0}
    sent_sum = {"w": 0.0, "b": 0.0}
    gaps = []
    for delta in _deltas(rounds):
        to_send = ef.compensate(3, delta)
        decoded, _ = roundtrip(to_send)
        ef.update(3, to_send, decoded)
        for k in delta:
            true_sum[k] = true_sum[k] + delta[k].astype(np.float64)
            sent_sum[k] = sent_sum[k] + decoded[k]
        gap = (sent_sum["w"] - true_sum["w"])[:, 1:]  # the values rounding sends as 0
        gaps.append((np.linalg.norm(gap) / np.linalg.norm(true_sum["w"][:, 1:]), np.abs(gap).max()))
    return np.array(gaps), true_sum, sent_sum


def test_running_sum_tracks_with_feedback_and_drifts_without():
    ef = ErrorFeedback()
    with_ef, true_sum, sent_sum = _run(ef)
    without, _, _ = _run(ErrorFeedback(enabled=False))
    # Without feedback the small values are never sent: their sum is lost entirely
    # and the absolute gap grows with every round.
    np.testing.assert_allclose(without[:, 0], 1.0)
    assert without[-1, 1] > 2 * without[9, 1]
    # With feedback the gap is the latest residual: at most half the widest gap
    # between NF4 levels (0.277 / 2 at scale 1/4 of 4x levels) in every round ...
    assert with_ef[:, 1].max() <= 0.139
    # ... so relative to the growing true sum it keeps shrinking.
    assert with_ef[-1, 0] < 0.5 * with_ef[4, 0] and with_ef[-1, 0] < 0.35
    # Telescoping: sum(sent) = sum(true) - latest residual, up to float rounding.
    for k in ("w", "b"):
        np.testing.assert_allclose(sent_sum[k], true_sum[k] - ef.residual(3)[k], atol=1e-4)


def test_residual_is_what_quantization_dropped():
    ef = ErrorFeedback()
    delta = next(_deltas(1))
    assert ef.compensate(0, delta)["w"] is delta["w"]  # nothing stored yet
    decoded, _ = roundtrip(delta)
    ef.update(0, delta, decoded)
    np.testing.assert_array_equal(ef.residual(0)["w"], delta["w"] - decoded["w"])
    comp = ef.compensate(0, delta)
    np.testing.assert_array_equal(comp["b"], delta["b"] + ef.residual(0)["b"])
    assert ef.residual(1) is None


def test_state_dict_roundtrip_and_reset():
    ef = ErrorFeedback()
    for p, delta in enumerate(_deltas(2)):
        ef.update(p, delta, roundtrip(delta)[0])
    state = ef.state_dict()
    assert set(state) == {"0/w", "0/b", "1/w", "1/b"}
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in state.values())
    other = ErrorFeedback()
    other.load_state_dict(state)
    for k, v in state.items():
        np.testing.assert_array_equal(other.state_dict()[k], v)
    other.reset(0)
    assert other.residual(0) is None and other.residual(1) is not None
    other.reset()
    assert other.state_dict() == {}


def test_bad_input_names_the_problem_and_changes_nothing():
    ef = ErrorFeedback()
    delta = next(_deltas(1))
    ef.update(2, delta, roundtrip(delta)[0])
    before = {k: v.copy() for k, v in ef.state_dict().items()}
    with pytest.raises(ValueError, match="tensor names differ"):
        ef.compensate(2, {"w": delta["w"]})
    with pytest.raises(ValueError, match="'b' has shape"):
        ef.update(2, delta, {"w": delta["w"], "b": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="expected '<fragment id>/<name>'"):
        ef.load_state_dict({"nofragment": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="float32"):
        ef.load_state_dict({"2/w": np.zeros(2, np.float64)})
    after = ef.state_dict()
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_disabled_feedback_is_a_no_op():
    ef = ErrorFeedback(enabled=False)
    delta = next(_deltas(1))
    ef.update(0, delta, roundtrip(delta)[0])
    assert ef.state_dict() == {} and ef.compensate(0, delta)["w"] is delta["w"]
