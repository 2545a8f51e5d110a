"""Merging learners' outer gradients (docs/method.md, "Merging"): token weights, weighted mean, RDA.

Outer gradients of different learners are nearly orthogonal, so a plain mean
shrinks like 1/sqrt(M); radial-directional averaging (RDA) averages norm and
direction separately so the merged norm is the weighted mean norm for any M.

The syncer merges hundreds of MB per round, so the work is cut into chunks of at most
``CHUNK`` values (tensor boundaries kept) that a thread pool runs on every core: numpy
releases the GIL inside its loops. Each chunk is computed the same way on any thread and
per-tensor sums add the chunks' partial sums in chunk order, so the result does not depend
on the number of workers.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Literal, Mapping, Sequence

import numpy as np

MergeMethod = Literal["rda", "mean"]

# Values per work item: 1 MiB of float32, so a chunk and its scratch stay in cache between the
# learners' passes, and there are enough items to keep every core busy.
CHUNK = 1 << 18


class Workers:
    """Runs a function over work items on ``n`` threads (None: one per core; 1: inline, no threads)."""

    _pools: dict[int, ThreadPoolExecutor] = {}
    _lock = threading.Lock()

    def __init__(self, n: int | None = None):
        if n is None:
            n = os.cpu_count() or 1
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"workers must be an integer >= 1, got {n!r}")
        self.n = n

    def map(self, fn: Callable, items: Sequence) -> list:
        if self.n == 1 or len(items) < 2:
            return [fn(x) for x in items]
        with Workers._lock:  # one pool per size, shared by every core of the process
            pool = Workers._pools.get(self.n)
            if pool is None:
                pool = Workers._pools[self.n] = ThreadPoolExecutor(self.n, thread_name_prefix="wan-diloco-merge")
        return list(pool.map(fn, items))


SERIAL = Workers(1)


def chunks(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tensor index, start, stop) of every work item over flat tensors of ``sizes``."""
    return [(t, a, min(a + CHUNK, n)) for t, n in enumerate(sizes) for a in range(0, n, CHUNK)]


def _per_tensor(n: int, items: Sequence[tuple[int, int, int]], parts: Sequence[float]) -> np.ndarray:
    """Sum the items' partial results per tensor, in item order (deterministic)."""
    out = np.zeros(n, np.float64)
    np.add.at(out, np.fromiter((t for t, _, _ in items), np.intp, len(items)), np.asarray(parts, np.float64))
    return out


def _sumsq(x: np.ndarray) -> float:
    """Σx² of one chunk: float32 einsum (SIMD, no temporary; a BLAS dot would spin up its threads),
    in float64 where float32 overflows so that finite values always give a finite sum."""
    s = float(np.einsum("i,i->", x, x))
    if s == np.inf:
        s = float(np.einsum("i,i->", x, x, dtype=np.float64))
    return s


def sum_squares(arrays: Sequence[np.ndarray], workers: Workers = SERIAL) -> np.ndarray:
    """Σx² per array (float64); NaN or Inf in an array gives a non-finite sum."""
    flats = [np.ravel(a) for a in arrays]
    items = chunks([f.size for f in flats])
    return _per_tensor(len(flats), items, workers.map(lambda it: _sumsq(flats[it[0]][it[1]:it[2]]), items))


def token_weights(c_tokens: Sequence[float], c_steps: Sequence[float]) -> np.ndarray:
    """w_m = c_tokens * (c_tokens / c_steps): quantity times quality (tokens per step).

    A learner with no steps since its last sync gets weight 0.
    """
    tokens = np.asarray(c_tokens, dtype=np.float64)
    steps = np.asarray(c_steps, dtype=np.float64)
    if tokens.shape != steps.shape:
        raise ValueError(f"token_weights: {tokens.shape} token counts but {steps.shape} step counts")
    if (tokens < 0).any() or (steps < 0).any():
        raise ValueError("token_weights: counts must be non-negative")
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(steps > 0, tokens * tokens / np.where(steps > 0, steps, 1.0), 0.0)
    return w


def _check_weights(m: int, weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if m == 0 or m != len(w):
        raise ValueError(f"merge: {m} deltas but {len(w)} weights")
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"merge: weights must be finite, non-negative and not all zero, got {w.tolist()}")
    return w


def _check_shapes(deltas: Sequence[np.ndarray], what: str = "") -> None:
    shape = np.shape(deltas[0])
    for d in deltas[1:]:
        if np.shape(d) != shape:
            raise ValueError(f"merge: shape mismatch {np.shape(d)} vs {shape}{what}")


_scratch = threading.local()


def _buffer(n: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = np.empty(CHUNK, np.float32)
    return buf[:n]


def merge_tensors(deltas: Sequence[Sequence[np.ndarray]], weights, use_rda: Sequence[bool],
                  workers: Workers = SERIAL) -> list[np.ndarray]:
    """Merge ``deltas[m][t]`` (learner m's Δ of tensor t) into one float32 array per tensor:
    RDA where ``use_rda[t]``, else the weighted mean Σ w_m Δ_m / Σ w_m.

    RDA: Δ = (Σ w‖Δ_m‖ / Σ w) · unit(Σ w·unit(Δ_m)); zero-norm Δ_m are skipped (they carry no
    direction); all-zero input, or directions that cancel exactly, give zeros. Sums run in float32
    with the coefficients scaled to at most 1 (no overflow); norms accumulate in float64.
    """
    w = _check_weights(len(deltas), weights)
    M, T = len(deltas), len(use_rda)
    flats = [[np.ravel(d) for d in ds] for ds in deltas]
    sizes = [f.size for f in flats[0]]
    coeffs = np.tile(w / w.sum(), (T, 1))  # (T, M)
    rda_t = [t for t in range(T) if use_rda[t]]
    mean_norm = np.zeros(T)
    if rda_t:
        sq = sum_squares([flats[m][t] for t in rda_t for m in range(M)], workers).reshape(len(rda_t), M)
        norms = np.sqrt(sq)
        for row, t in zip(norms, rda_t):  # per tensor, M scalars: no array work here
            keep = (row > 0) & (w > 0)
            inv = np.where(keep, w / np.where(keep, row, 1.0), 0.0)
            coeffs[t] = inv / inv.max() if keep.any() else 0.0
            mean_norm[t] = (w[keep] * row[keep]).sum() / w[keep].sum() if keep.any() else 0.0
    c32 = coeffs.astype(np.float32)
    out = [np.empty(n, np.float32) for n in sizes]
    items = chunks(sizes)

    def accumulate(it) -> float:
        t, a, b = it
        o = out[t][a:b]
        ms = [m for m in range(M) if c32[t, m] != 0]
        if not ms:
            o.fill(0.0)
            return 0.0
        np.multiply(flats[ms[0]][t][a:b], c32[t, ms[0]], out=o)
        tmp = _buffer(b - a)
        for m in ms[1:]:
            np.multiply(flats[m][t][a:b], c32[t, m], out=tmp)
            o += tmp
        return _sumsq(o) if use_rda[t] else 0.0

    dsq = _per_tensor(T, items, workers.map(accumulate, items))
    factor = np.ones(T, np.float32)
    for t in rda_t:
        factor[t] = mean_norm[t] / np.sqrt(dsq[t]) if dsq[t] > 0 else 0.0
    rescale = [it for it in items if use_rda[it[0]]]

    def scale(it) -> None:
        t, a, b = it
        out[t][a:b] *= factor[t]

    workers.map(scale, rescale)
    return [o.reshape(np.shape(ds)) for o, ds in zip(out, deltas[0])]


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Σ w_m Δ_m / Σ w_m, as float32."""
    _check_weights(len(deltas), weights)
    _check_shapes(deltas)
    return merge_tensors([[d] for d in deltas], weights, [False])[0]


def rda(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional average of one tensor's outer gradients (see ``merge_tensors``)."""
    _check_weights(len(deltas), weights)
    _check_shapes(deltas)
    return merge_tensors([[d] for d in deltas], weights, [True])[0]


def merge_fragment(
    contributions: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    method: MergeMethod,
    is_embedding: Callable[[str], bool],
    workers: Workers = SERIAL,
) -> dict[str, np.ndarray]:
    """Merge per-learner fragments {name: Δ}: RDA per tensor (or mean), embeddings by mean."""
    if not contributions:
        raise ValueError("merge: no contributions")
    names = list(contributions[0])
    for c in contributions[1:]:
        if list(c) != names:
            raise ValueError(f"merge: contributions name different tensors: {sorted(set(c) ^ set(names))[:3]}")
    for n in names:
        _check_shapes([c[n] for c in contributions], f" in {n!r}")
    use_rda = [method == "rda" and not is_embedding(n) for n in names]
    merged = merge_tensors([[np.asarray(c[n]) for n in names] for c in contributions], weights, use_rda, workers)
    return dict(zip(names, merged))
