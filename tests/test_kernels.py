"""The compiled loops give the bits of the numpy expressions they replace, edge values included, on threads."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wan_diloco import kernels
from wan_diloco.merge import Workers

EDGES = np.float32([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, 1.0, -1.0])


def _values(seed: int, n: int = 70_001) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(n) * 10.0 ** np.random.default_rng(seed + 1).integers(-30, 30, n))
    x = x.astype(np.float32)
    x[:EDGES.size] = EDGES
    return x


def _same_bits(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("keep", [np.float32(1), np.float32(0.37), np.float32(1e-30)])
def test_scaled_add_is_numpys_multiply_then_add(keep):
    s, x, k = _values(0), _values(2), np.float32(-2.5)
    with np.errstate(all="ignore"):
        want = np.add(np.multiply(s, keep), np.multiply(x, k))
    got = s.copy()
    kernels.scaled_add(got, keep, x, k)
    _same_bits(got, want)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_update_and_commit_are_optaxs_order_of_operations(nesterov):
    t, g, mu, neg_lr = _values(4), _values(6), np.float32(0.9), np.float32(-0.7)
    with np.errstate(all="ignore"):
        v = t * mu + g
        want = (v * mu + g if nesterov else v) * neg_lr
    u = np.empty_like(t)
    kernels.outer_update(t, g, mu, neg_lr, nesterov, u)
    _same_bits(u, want)
    g2 = g.copy()
    u2 = np.empty_like(t)
    kernels.outer_advance(t, g2, mu, neg_lr, nesterov, u2)  # both in one pass, the new trace over g
    _same_bits(u2, want)
    _same_bits(g2, v)
    kernels.momentum_commit(t, g, mu)
    _same_bits(t, v)


def test_block_absmax_bits_is_the_max_of_abs_and_flags_every_non_finite_block():
    x = _values(8, 64 * 300).reshape(300, 64)
    x[5:] = np.nan_to_num(x[5:], nan=0.0, posinf=1.0, neginf=-1.0)  # the edge values sit in blocks 0..4
    x[7, 3] = -np.inf
    got = np.empty(300, np.uint32)
    kernels.block_absmax_bits(x.view(np.uint32), got)
    with np.errstate(invalid="ignore"):
        want = np.max(np.abs(x), axis=1)
    finite = np.isfinite(want)
    _same_bits(got.view(np.float32)[finite], want[finite])
    assert not np.isfinite(got.view(np.float32)[~finite]).any()
    assert (~finite).sum() == 2  # block 0 (Inf, NaN), block 7 (−Inf)


def test_the_loops_release_the_gil_and_run_on_several_threads_at_once_with_the_same_bits():
    # Without nogil the pool's threads would take turns: every loop must release the GIL.
    loops = [f for f in vars(kernels).values() if hasattr(f, "targetoptions")]
    assert len(loops) == 13 and all(f.targetoptions.get("nogil") for f in loops), [f.__name__ for f in loops]
    s, x, k = _values(10, 1 << 20), _values(12, 1 << 20), np.float32(0.5)
    items = [(a, a + (1 << 16)) for a in range(0, 1 << 20, 1 << 16)]
    one, four = s.copy(), s.copy()
    for a, b in items:
        kernels.scaled_add(one[a:b], np.float32(1), x[a:b], k)
    Workers(4).map(lambda it: kernels.scaled_add(four[it[0]:it[1]], np.float32(1), x[it[0]:it[1]], k), items)
    _same_bits(four, one)


@pytest.mark.parametrize("with_plus", [True, False])
def test_difference_plus_is_numpys_subtract_then_add(with_plus):
    a, b, c = _values(14), _values(16), _values(18)
    with np.errstate(all="ignore"):
        want = (a - b) + c if with_plus else a - b
    out = np.empty_like(a)
    kernels.difference_plus(a, b, c if with_plus else np.empty(0, np.float32), out)
    _same_bits(out, want)


def test_the_module_imports_and_runs_where_numba_has_no_writable_cache_directory():
    # A read-only install with no writable home (a container run as another user): numba's cache finds no
    # place and raises at decoration; the loops must then compile in the process instead.
    code = """
import numba.core.caching as caching
(getattr(caching, "CacheImpl", None) or caching._CacheImpl)._locator_classes = []
import numpy as np
from wan_diloco import kernels
s = np.ones(8, np.float32)
kernels.scaled_add(s, np.float32(1), np.full(8, 2, np.float32), np.float32(0.5))
assert (s == 2).all(), s
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _decoded(bits: int, codes, scales, lo, hi) -> np.ndarray:
    """The decoder's values of (k, 64) blocks, flat: ``dequantize4`` (4 bits) or numpy's int8 × scale."""
    x = np.empty((codes.shape[0], 64), np.float32)
    if bits == 4:
        kernels.dequantize4(codes, scales, lo, hi, x)
    else:
        np.multiply(codes, scales[:, None], out=x)
    return x.reshape(-1)


@pytest.mark.parametrize("keep", [np.float32(0), np.float32(1), np.float32(0.37)])
@pytest.mark.parametrize("pad", [0, 5, 63])
def test_fold4_and_fold8_are_decoding_then_folding(keep, pad):
    from wan_diloco.compression.blocks import nibble_levels
    k = 300
    rng = np.random.default_rng(12)
    codes = rng.integers(0, 256, (k, 32), dtype=np.uint8)
    scales = _values(14, k)
    scales[:EDGES.size] = np.abs(EDGES)
    lo, hi = nibble_levels("nf4")
    for bits in (4, 8):
        c = codes if bits == 4 else rng.integers(-127, 128, (k, 64)).astype(np.int8)
        with np.errstate(all="ignore"):
            x = _decoded(bits, c, scales, lo, hi)[:k * 64 - pad]
            s, kk = _values(16, x.size), np.float32(-2.5)
            want = np.multiply(x, kk) if keep == 0 else np.add(np.multiply(s, keep), np.multiply(x, kk))
        got = s.copy() if keep else np.full_like(s, np.nan)  # keep 0: whatever the sums held is overwritten
        if bits == 4:
            kernels.fold4(c, scales, lo, hi, got, keep, kk)
        else:
            kernels.fold8(c, scales, got, keep, kk)
        _same_bits(got, want)


@pytest.mark.parametrize("pad", [0, 5, 63])
def test_add_decoded_is_decoding_then_numpys_add(pad):
    from wan_diloco.compression.blocks import nibble_levels
    k = 300
    rng = np.random.default_rng(13)
    scales = np.abs(_values(15, k))
    lo, hi = nibble_levels("uniform")
    for bits in (4, 8):
        c = (rng.integers(0, 256, (k, 32), dtype=np.uint8) if bits == 4
             else rng.integers(-127, 128, (k, 64)).astype(np.int8))
        with np.errstate(all="ignore"):
            base = _values(17, k * 64 - pad)
            want = np.add(base, _decoded(bits, c, scales, lo, hi)[:base.size])
        got = np.full_like(base, np.nan)
        if bits == 4:
            kernels.add_decoded4(c, scales, lo, hi, base, got)
        else:
            kernels.add_decoded8(c, scales, base, got)
        _same_bits(got, want)
