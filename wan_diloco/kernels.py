"""Compiled loops (numba) for the host's hot passes: one pass over the values where numpy makes several.

The codec's 4-bit passes: numpy decodes a 4-bit block in three passes (a table gather, a transposing
copy, the scale multiply) and quantizes it in seventeen (|x|, the max, the multiply, fifteen
compares): each pass streams the chunk through the cache again. These loops do the same float32 operations in the same order, one
value at a time, so every code, scale and decoded value is the same bits as numpy's and jax.numpy's
(tests/compression pin them): a product ``level × scale`` or ``x × (1/scale)`` is one IEEE multiply
wherever it runs, and LLVM does not contract a multiply and an add into an FMA unless asked (numba
never asks without ``fastmath``). The merge's fold and the outer step are the same: numpy's chain of
in-place ops over a chunk (each a pass through the cache) becomes one loop with the same operations in
the same order. The loops release the GIL, so ``merge.Workers`` runs them on every core.

Each loop is compiled for its one signature (C-contiguous float32/uint8 arrays; inputs read-only, so a
read-only array passes too) when this module is imported, and cached next to it (or in numba's user
cache directory where the package is read-only): the first import on a host compiles them (a few
seconds), later ones load them (~0.25 s, after numba's own import of ~0.15 s). Where no cache directory is writable they are compiled at
every import. Compiling on first call instead would put that pause into a run's first encode, where a
learner notices it.

The sums of squares stay numpy's (``merge.chunk_sum_squares``): their bits depend on its order of
addition, and encoder and decoder must agree on them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types

_JIT = dict(nogil=True, boundscheck=False, error_model="numpy")
_f32, _u8, _u32 = types.float32, types.uint8, types.uint32


def _compiled(*signatures):
    """``njit`` for these signatures, cached on disk where numba finds a writable place, else not."""
    def wrap(fn):
        try:
            return njit(list(signatures), cache=True, **_JIT)(fn)
        except RuntimeError:  # "no locator available": a read-only install and no writable cache directory
            return njit(list(signatures), cache=False, **_JIT)(fn)
    return wrap


def _in(dtype, ndim: int):
    """A read-only C-contiguous array argument (writable arrays convert to it)."""
    return types.Array(dtype, ndim, "C", readonly=True)


def _out(dtype, ndim: int):
    return types.Array(dtype, ndim, "C")


def _quantize4_sig(n_mids: int):
    return types.void(_in(_f32, 2), _in(_f32, 1), _in(_f32, 1), types.UniTuple(_f32, n_mids), _in(_f32, 1),
                      _out(_u8, 2), _out(_f32, 2), _out(_f32, 2))


@_compiled(types.void(_in(_u8, 2), _in(_f32, 1), _in(_f32, 1), _in(_f32, 1), _out(_f32, 2)))
def dequantize4(codes, scales, lo, hi, out):
    """4-bit blocks: ``out[i, j] = lo[codes[i, j]] · scales[i]`` and ``out[i, j + h] = hi[...] · scales[i]``.

    codes (k, h) uint8; scales (k,) float32; lo, hi (256,) float32: the levels of a byte's low and high
    nibble; out (k, 2h) float32."""
    k, h = codes.shape
    for i in range(k):
        s = scales[i]
        for j in range(h):
            c = codes[i, j]
            out[i, j] = lo[c] * s
            out[i, j + h] = hi[c] * s


@_compiled(types.void(_in(_u32, 2), _out(_u32, 1)))
def block_absmax_bits(bits, out):
    """``out[i]``: the largest |x| bit pattern of block i (``bits``: the float32 blocks viewed as uint32).

    Non-negative floats order as their bit patterns do, so this is the bits of ``max |x|`` for a finite
    block, and at least 0x7F800000 (Inf or NaN) for one holding Inf or NaN: the caller's scale is NaN
    either way, as numpy's. An integer max is a reduction LLVM vectorizes; a float one it may not."""
    k, bs = bits.shape
    for i in range(k):
        m = np.uint32(0)
        for j in range(bs):
            m = max(m, bits[i, j] & np.uint32(0x7FFFFFFF))
        out[i] = m


@_compiled(_quantize4_sig(15), _quantize4_sig(14))  # the midpoints of NF4's 16 levels, uniform's 15
def quantize4(x, inv, scales, mids, levels, codes, dec, res):
    """Round to nearest 4-bit codes: per value y = x · inv[i], its code the number of ``mids`` below y
    (the midpoints between neighbouring levels, ascending: a tuple, so the loop over them unrolls and
    the loop over a block's values vectorizes; over an array it ran 10x slower); codes (k, h) uint8
    pack code j in the low nibble and code j + h in the high one. With ``dec`` non-empty also the
    decoded values ``levels[code] · scales[i]``, and with ``res`` non-empty x − decoded (both (k, 2h)
    float32)."""
    k, bs = x.shape
    h = bs // 2
    want_dec, want_res = dec.shape[0] > 0, res.shape[0] > 0
    q = np.empty(bs, np.int32)
    for i in range(k):
        f = inv[i]
        for j in range(bs):
            y = x[i, j] * f
            c = np.int32(0)
            for m in mids:
                c += np.int32(y > m)
            q[j] = c
        for j in range(h):
            codes[i, j] = np.uint8(q[j] | (q[j + h] << 4))
        if want_dec:
            s = scales[i]
            for j in range(bs):
                dec[i, j] = levels[q[j]] * s
            if want_res:
                for j in range(bs):
                    res[i, j] = x[i, j] - dec[i, j]


@njit(inline="always", **_JIT)
def _block_levels(codes, i, lo, hi, x):
    """x[j], x[j + h] ← the levels of block i's byte j (its low and high nibble): the loops that use a 4-bit
    block's values gather them here first, so the arithmetic over x vectorizes."""
    h = codes.shape[1]
    for j in range(h):
        c = codes[i, j]
        x[j] = lo[c]
        x[j + h] = hi[c]


@_compiled(types.void(_in(_u8, 2), _in(_f32, 1), _in(_f32, 1), _in(_f32, 1), _out(_f32, 1), _f32, _f32))
def fold4(codes, scales, lo, hi, s, keep, k):
    """``dequantize4`` straight into a merge's fold: s ← s·keep + x·k for the decoded values x of the 4-bit
    blocks (s ← x·k where keep is 0: s holds nothing yet), x never written out. ``s`` holds the first
    s.size values of the blocks (a tensor's last block is padded). The same operations as ``dequantize4``
    then ``scaled_add`` (or numpy's multiply), so the same bits. A block's levels are gathered into a
    small buffer first: the fold over it then vectorizes (10 % faster than one loop doing both)."""
    kb, h = codes.shape
    bs, n = 2 * h, s.size
    x = np.empty(bs, np.float32)
    for i in range(kb):
        sc, base = scales[i], i * bs
        _block_levels(codes, i, lo, hi, x)
        m = min(bs, n - base)
        if keep == 0:
            for j in range(m):
                s[base + j] = (x[j] * sc) * k
        else:
            for j in range(m):
                s[base + j] = s[base + j] * keep + (x[j] * sc) * k


@_compiled(types.void(_in(_u8, 2), _in(_f32, 1), _in(_f32, 1), _in(_f32, 1), _in(_f32, 1), _out(_f32, 1)))
def add_decoded4(codes, scales, lo, hi, base, out):
    """out ← base + x for the decoded values x of the 4-bit blocks (``dequantize4``'s), x never written out:
    the same bits as ``dequantize4`` then numpy's add. ``base`` and ``out`` hold the first out.size values of
    the blocks (a tensor's last block is padded); out may be base."""
    kb, h = codes.shape
    bs, n = 2 * h, out.size
    x = np.empty(bs, np.float32)
    for i in range(kb):
        sc, first = scales[i], i * bs
        _block_levels(codes, i, lo, hi, x)
        for j in range(min(bs, n - first)):
            out[first + j] = base[first + j] + x[j] * sc


@_compiled(types.void(_in(types.int8, 2), _in(_f32, 1), _in(_f32, 1), _out(_f32, 1)))
def add_decoded8(codes, scales, base, out):
    """``add_decoded4`` for int8 blocks: x = float32(code) · scale."""
    kb, bs = codes.shape
    n = out.size
    for i in range(kb):
        sc, first = scales[i], i * bs
        for j in range(min(bs, n - first)):
            out[first + j] = base[first + j] + np.float32(codes[i, j]) * sc


@_compiled(types.void(_in(types.int8, 2), _in(_f32, 1), _out(_f32, 1), _f32, _f32))
def fold8(codes, scales, s, keep, k):
    """``fold4`` for int8 blocks: x = float32(code) · scale, as numpy's int8 × float32 multiply."""
    kb, bs = codes.shape
    n = s.size
    for i in range(kb):
        sc, base = scales[i], i * bs
        for j in range(min(bs, n - base)):
            x = np.float32(codes[i, j]) * sc
            s[base + j] = x * k if keep == 0 else s[base + j] * keep + x * k


@_compiled(types.void(_out(_f32, 1), _f32, _in(_f32, 1), _f32))
def scaled_add(s, keep, x, k):
    """s ← s·keep + x·k in place (float32 1-D; ``merge._scaled_add``'s keep ≠ 0 case: s·1 is s)."""
    for i in range(s.size):
        s[i] = s[i] * keep + x[i] * k


@_compiled(types.void(_in(_f32, 1), _in(_f32, 1), _f32, _f32, types.boolean, _out(_f32, 1)))
def outer_update(trace, g, mu, neg_lr, nesterov, u):
    """optax's SGD-with-momentum update from the old trace: u = −lr·(g + μ·(g + μ·trace)) with Nesterov,
    −lr·(g + μ·trace) without (float32 1-D, the operations in optax's order)."""
    for i in range(u.size):
        v = trace[i] * mu + g[i]
        if nesterov:
            v = v * mu + g[i]
        u[i] = v * neg_lr


@_compiled(types.void(_in(_f32, 1), _out(_f32, 1), _f32, _f32, types.boolean, _out(_f32, 1)))
def outer_advance(trace, g, mu, neg_lr, nesterov, u):
    """``outer_update`` and ``momentum_commit`` in one pass, the new trace written over g: u as
    ``outer_update`` computes it from the old trace, then g ← trace·μ + g (each g[i] read before it is
    written). The syncer's close: the merged Δ is not needed once its momentum is taken."""
    for i in range(u.size):
        gi = g[i]
        v = trace[i] * mu + gi
        w = v * mu + gi if nesterov else v
        u[i] = w * neg_lr
        g[i] = v


@_compiled(types.void(_out(_f32, 1), _in(_f32, 1), _f32))
def momentum_commit(trace, g, mu):
    """trace ← trace·μ + g in place (float32 1-D)."""
    for i in range(trace.size):
        trace[i] = trace[i] * mu + g[i]


@_compiled(types.void(_in(_f32, 1), _in(_f32, 1), _in(_f32, 1), _out(_f32, 1)))
def difference_plus(a, b, c, out):
    """out = (a − b) + c, or a − b where c is empty (float32 1-D): a learner's Δ = Θ − θ plus its
    error-feedback residual in one pass (numpy: two, each into a new array)."""
    if c.size == 0:
        for i in range(out.size):
            out[i] = a[i] - b[i]
    else:
        for i in range(out.size):
            out[i] = (a[i] - b[i]) + c[i]
