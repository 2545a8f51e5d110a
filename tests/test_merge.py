import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wan_diloco import merge


def test_token_weights_quantity_times_quality():
    w = merge.token_weights([100, 100, 50], [10, 5, 5])
    np.testing.assert_allclose(w, [100 * 10, 100 * 20, 50 * 10])
    assert merge.token_weights([10], [0])[0] == 0.0


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_rda_norm_is_weighted_mean_norm(m, seed):
    rng = np.random.default_rng(seed)
    ds = [rng.normal(size=64).astype(np.float32) * rng.uniform(0.1, 3) for _ in range(m)]
    w = rng.uniform(0.1, 2, size=m)
    out = merge.rda(ds, w)
    expected = (w * [np.linalg.norm(d) for d in ds]).sum() / w.sum()
    np.testing.assert_allclose(np.linalg.norm(out), expected, rtol=1e-5)


def test_identical_deltas_return_delta():
    d = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    for m in (1, 3, 7):
        np.testing.assert_allclose(merge.rda([d] * m, np.linspace(1, 2, m)), d, rtol=1e-6)


def test_orthogonal_units_keep_norm_where_mean_shrinks():
    for m in (2, 4, 16):
        ds = list(np.eye(m, dtype=np.float32))
        w = np.ones(m)
        assert np.linalg.norm(merge.rda(ds, w)) == pytest.approx(1.0, rel=1e-6)
        assert np.linalg.norm(merge.weighted_mean(ds, w)) == pytest.approx(1 / np.sqrt(m), rel=1e-6)


def test_zero_norm_delta_is_skipped():
    d = np.array([3.0, 4.0], dtype=np.float32)
    out = merge.rda([d, np.zeros(2, np.float32)], [1.0, 1.0])
    np.testing.assert_allclose(out, d)  # the zero delta neither shrinks the norm nor the direction
    assert not merge.rda([np.zeros(2, np.float32)], [1.0]).any()


def test_weighted_mean_uses_weights():
    out = merge.weighted_mean([np.ones(3, np.float32), np.zeros(3, np.float32)], [3, 1])
    np.testing.assert_allclose(out, 0.75)


def test_merge_fragment_embeddings_use_mean():
    a = {"embed/embedding": np.array([1.0, 0.0], np.float32), "block_0/w": np.array([1.0, 0.0], np.float32)}
    b = {"embed/embedding": np.array([0.0, 1.0], np.float32), "block_0/w": np.array([0.0, 1.0], np.float32)}
    out = merge.merge_fragment([a, b], [1, 1], "rda", lambda n: n.startswith("embed"))
    assert np.linalg.norm(out["embed/embedding"]) == pytest.approx(np.sqrt(0.5))
    assert np.linalg.norm(out["block_0/w"]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "deltas, weights, match",
    [
        ([], [], "0 deltas"),
        ([np.ones(2)], [1, 2], "1 deltas but 2"),
        ([np.ones(2), np.ones(3)], [1, 1], "shape mismatch"),
        ([np.ones(2)], [0], "not all zero"),
        ([np.ones(2)], [np.nan], "finite"),
    ],
)
def test_bad_inputs(deltas, weights, match):
    with pytest.raises(ValueError, match=match):
        merge.rda(deltas, weights)


def _fragments(m, seed=0):
    """M learners' Δs of a fragment whose big tensor spans several chunks (and a ragged tail)."""
    rng = np.random.default_rng(seed)
    shapes = {"block_0/w": (3, merge.CHUNK + 11), "block_0/b": (5,), "embed/embedding": (merge.CHUNK // 2 + 3, 2)}
    return [{n: (rng.normal(size=s) * rng.uniform(0.1, 2)).astype(np.float32) for n, s in shapes.items()}
            for _ in range(m)]


def _reference(contributions, w, method):
    """The float64 formulas, tensor by tensor."""
    w = np.asarray(w, np.float64)
    out = {}
    for n in contributions[0]:
        ds = [c[n].astype(np.float64) for c in contributions]
        if method == "rda" and not n.startswith("embed"):
            norms = np.array([np.linalg.norm(d) for d in ds])
            direction = sum(wm / nm * d for wm, nm, d in zip(w, norms, ds))
            out[n] = direction / np.linalg.norm(direction) * (w * norms).sum() / w.sum()
        else:
            out[n] = sum(wm * d for wm, d in zip(w, ds)) / w.sum()
    return out


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_parallel_merge_equals_serial_bit_for_bit_and_the_float64_formulas(method):
    cs = _fragments(4)
    w = [1.0, 3.0, 0.5, 2.0]
    serial = merge.merge_fragment(cs, w, method, lambda n: n.startswith("embed"))
    parallel = merge.merge_fragment(cs, w, method, lambda n: n.startswith("embed"), merge.Workers(3))
    ref = _reference(cs, w, method)
    for n in ref:
        assert serial[n].dtype == np.float32 and serial[n].shape == ref[n].shape
        np.testing.assert_array_equal(serial[n].view(np.uint32), parallel[n].view(np.uint32))
        np.testing.assert_allclose(serial[n], ref[n], rtol=2e-5, atol=1e-6 * np.abs(ref[n]).max())


def test_sum_squares_per_tensor():
    big = np.linspace(-1, 1, merge.CHUNK * 2 + 5, dtype=np.float32)
    arrays = [big, np.float32([3, 4]), np.zeros(0, np.float32), np.float32([1e30, 1e30])]
    for workers in (merge.SERIAL, merge.Workers(2)):
        got = merge.sum_squares(arrays, workers)
        np.testing.assert_allclose(got[:3], [np.sum(big.astype(np.float64) ** 2), 25.0, 0.0], rtol=1e-6)
        assert got[3] == pytest.approx(2e60)  # float32 squares overflow: summed in float64 instead
    assert not np.isfinite(merge.sum_squares([np.float32([1, np.nan]), np.float32([np.inf])])).any()


def test_chunks_cover_every_value_once():
    sizes = [0, 1, merge.CHUNK, merge.CHUNK * 2 + 1]
    items = merge.chunks(sizes)
    for t, n in enumerate(sizes):
        spans = [(a, b) for i, a, b in items if i == t]
        assert sum(b - a for a, b in spans) == n and all(b - a <= merge.CHUNK for a, b in spans)


@pytest.mark.parametrize("n", [2, 3])
def test_workers_give_every_result_in_item_order_and_the_first_failure_in_item_order(n):
    import threading
    import time
    ran, names = [], set()

    def fn(x):
        ran.append(x)
        names.add(threading.current_thread().name)
        time.sleep(0.001 * (x % 3))  # items finish out of order
        if x in (7, 4):
            raise KeyError(x)
        return x * x

    assert merge.Workers(n).map(lambda x: x + 1, list(range(50))) == list(range(1, 51))
    with pytest.raises(KeyError) as e:
        merge.Workers(n).map(fn, list(range(40)))
    assert e.value.args == (4,) and sorted(ran) == list(range(40))  # every item ran; item 4's error, not 7's
    assert len(names) > 1  # the caller and a pool thread shared the items


@pytest.mark.timeout(60)
def test_workers_called_from_a_worker_do_not_deadlock():
    w = merge.Workers(2)
    assert w.map(lambda x: sum(w.map(lambda y: x * y, list(range(5)))), list(range(8))) == [10 * x for x in range(8)]


def test_a_map_whose_helpers_never_started_keeps_nothing_of_its_items_alive():
    # Every pool thread busy: the caller runs every item, the helpers' tasks are cancelled but stay queued.
    import threading
    w = merge.Workers(2)
    w.map(lambda x: x, [0, 1])  # the pool exists
    release = threading.Event()
    blockers = [merge.Workers._pools[2].submit(release.wait) for _ in range(2)]
    try:
        buf = bytearray(64)
        view = np.frombuffer(buf, np.uint8)

        def write(i, view=view):  # a default, not a closure cell: ``del view`` below cannot clear it
            view[i] = i
            return i

        assert w.map(write, list(range(8))) == list(range(8))
        del view, write
        del buf[32:]  # BufferError if a queued task still held the closure and its view of buf
        assert bytes(buf[:8]) == bytes(range(8))
    finally:
        release.set()
        for b in blockers:
            b.result()


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        merge.Workers(0)


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_accumulating_deltas_as_they_arrive_gives_the_formulas_and_the_same_bits_on_any_threads(method):
    # Weights grow then shrink, so later Δs rescale the running sums (coefficients stay <= 1).
    cs = _fragments(5)
    w = [0.5, 4.0, 1.0, 9.0, 2.0]
    names = list(cs[0])
    use_rda = [method == "rda" and not n.startswith("embed") for n in names]
    ref = _reference(cs, w, method)
    outs = []
    for n_workers in (1, 2, 4):
        acc = merge.Accumulator([cs[0][n].shape for n in names], use_rda, merge.Workers(n_workers))
        for c, wm in zip(cs, w):
            acc.add([c[n] for n in names], wm)
        assert acc.count == 5 and len(acc.sums) == len(names)  # one set of sums, whatever M
        outs.append(dict(zip(names, acc.result())))
    for n in names:
        np.testing.assert_allclose(outs[0][n], ref[n], rtol=2e-5, atol=1e-6 * np.abs(ref[n]).max())
        for other in outs[1:]:
            np.testing.assert_array_equal(outs[0][n].view(np.uint32), other[n].view(np.uint32))


def test_zero_weights_count_only_while_every_weight_is_zero():
    a, b, c = np.float32([1, 0]), np.float32([0, 3]), np.float32([5, 5])
    for method in (True, False):
        acc = merge.Accumulator([(2,)], [method])
        acc.add([a], 0.0)
        acc.add([b], 0.0)
        expected = merge.merge_tensors([[a], [b]], [1, 1], [method])[0]
        np.testing.assert_allclose(acc.result()[0], expected, rtol=1e-6)
        acc = merge.Accumulator([(2,)], [method])
        acc.add([a], 0.0)  # folded with weight 1 until a positive weight comes ...
        acc.add([c], 2.0)  # ... then it stops counting
        acc.add([b], 0.0)
        np.testing.assert_allclose(acc.result()[0], c, rtol=1e-6)


def test_absorbing_another_rounds_sums_is_adding_its_deltas():
    cs, w = _fragments(4), [1.0, 3.0, 0.5, 2.0]
    names = list(cs[0])
    shapes, use_rda = [cs[0][n].shape for n in names], [not n.startswith("embed") for n in names]
    one, first, second = (merge.Accumulator(shapes, use_rda) for _ in range(3))
    for i, (c, wm) in enumerate(zip(cs, w)):
        one.add([c[n] for n in names], wm)
        (first if i < 2 else second).add([c[n] for n in names], wm)
    first.absorb(second)
    for x, y in zip(one.result(), first.result()):
        np.testing.assert_allclose(y, x, rtol=2e-5, atol=1e-6 * np.abs(x).max())  # float32 rounding apart


def test_a_bad_weight_or_size_is_refused_before_the_sums_change():
    acc = merge.Accumulator([(3,)], [True])
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weights"):
            acc.add([np.ones(3, np.float32)], bad)
    with pytest.raises(ValueError, match="sizes"):
        acc.add([np.ones(4, np.float32)], 1.0)
    assert acc.count == 0 and acc.sums is None
    with pytest.raises(ValueError, match="no contributions"):
        acc.result()
