"""Merging learners' outer gradients (docs/method.md, "Merging"): token weights, weighted mean, RDA.

Outer gradients of different learners are nearly orthogonal, so a plain mean
shrinks like 1/sqrt(M); radial-directional averaging (RDA) averages norm and
direction separately so the merged norm is the weighted mean norm for any M. Both are sums
over the learners, so ``Accumulator`` folds each Δ in as it arrives (the syncer's rounds);
``merge_tensors`` and the functions after it merge a list at once through it.

The syncer merges hundreds of MB per round, so the work is cut into chunks of at most
``CHUNK`` values (tensor boundaries kept) that a thread pool runs on every core: numpy
releases the GIL inside its loops. Each chunk is computed the same way on any thread and
per-tensor sums add the chunks' partial sums in chunk order, so the result does not depend
on the number of workers.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Literal, Mapping, Sequence

import numpy as np

from wan_diloco import kernels
from wan_diloco.buffers import POOL
MergeMethod = Literal["rda", "mean"]

# Values per work item: 1 MiB of float32, so a chunk and its scratch stay in cache between the
# learners' passes, and there are enough items to keep every core busy.
CHUNK = 1 << 18


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Workers:
    """Runs a function over work items on ``n`` threads (None: one per core; 1: inline, no threads)."""

    _pools: dict[int, ThreadPoolExecutor] = {}
    _lock = threading.Lock()

    def __init__(self, n: int | None = None):
        if n is None:
            n = host_cores()
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"workers must be an integer >= 1, got {n!r}")
        self.n = n

    def map(self, fn: Callable, items: Sequence) -> list:
        """``[fn(x) for x in items]``, the items shared out as threads come free; every item runs, and the
        first failing item's exception (in item order) is raised, as a serial loop's would be."""
        if self.n == 1 or len(items) < 2:
            return [fn(x) for x in items]
        with Workers._lock:  # one pool per size, shared by every core of the process
            pool = Workers._pools.get(self.n)
            if pool is None:
                pool = Workers._pools[self.n] = ThreadPoolExecutor(self.n, thread_name_prefix="wan-diloco-merge")
        # One task per thread taking items off a shared counter, the caller one of them: a future and a
        # hand-off per item cost more than a memory-bound item's work (2 threads ran a fold slower than 1).
        job = _Job(fn, items)
        helpers = [pool.submit(_drain, job) for _ in range(min(self.n, len(items)) - 1)]
        _drain(job)
        for f in helpers:
            if not f.cancel():  # one not yet started finds nothing left: never waited on (no deadlock when nested)
                f.result()
        # A cancelled task stays in the pool's queue until a thread takes it: it must not keep ``fn`` (and the
        # buffers its closure views) alive, or a caller could not resize a buffer its items wrote into.
        out, errors = job.out, job.errors
        job.fn = job.items = job.out = job.errors = None
        if errors:
            raise errors[min(errors)]
        return out


class _Job:
    """One ``Workers.map``: its items, their results and errors by index, and the counter handing them out."""

    __slots__ = ("fn", "items", "out", "errors", "order")

    def __init__(self, fn: Callable, items: Sequence):
        self.fn, self.items = fn, items
        self.out: list | None = [None] * len(items)
        self.errors: dict[int, BaseException] | None = {}
        self.order = itertools.count()  # next() on it is atomic under the GIL


def _drain(job: _Job) -> None:
    """Run items of ``job`` until none is left (or the job was closed before this task started)."""
    fn, items, out, errors = job.fn, job.items, job.out, job.errors
    if fn is None:
        return
    for i in job.order:
        if i >= len(items):
            return
        try:
            out[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 (raised by map, in item order)
            errors[i] = e


SERIAL = Workers(1)


def chunks(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tensor index, start, stop) of every work item over flat tensors of ``sizes``."""
    return [(t, a, min(a + CHUNK, n)) for t, n in enumerate(sizes) for a in range(0, n, CHUNK)]


def per_tensor(n: int, items: Sequence[tuple], parts: Sequence[float]) -> np.ndarray:
    """Sum the items' partial results per tensor (an item's first field), in item order (deterministic)."""
    out = np.zeros(n, np.float64)
    np.add.at(out, np.fromiter((it[0] for it in items), np.intp, len(items)), np.asarray(parts, np.float64))
    return out


def chunk_sum_squares(x: np.ndarray) -> float:
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
    return per_tensor(len(flats), items, workers.map(lambda it: chunk_sum_squares(flats[it[0]][it[1]:it[2]]), items))


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


def _scaled_add(s: np.ndarray, keep: np.float32, x: np.ndarray, k: np.float32) -> None:
    """s ← keep·s + k·x in place, in float32 (keep = 0: s holds nothing yet and is overwritten)."""
    if keep == 0:
        np.multiply(x, k, out=s)
        return
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    kernels.scaled_add(s, np.float32(keep), x, np.float32(k))  # one pass: numpy took two or three over the chunk


class Accumulator:
    """One merge's running sums: each Δ is folded in as it arrives (``add``), so a round holds one
    fragment of float32 sums, not M decoded Δs; ``result`` gives the merge (``merge_tensors``).

    Per tensor t it keeps S_t = Σ (c_m / r_t)·Δ_m in float32, where c_m is w_m for the weighted mean
    and w_m / ‖Δ_m,t‖ for RDA, and r_t the largest c_m so far (coefficients stay ≤ 1: no overflow;
    a larger one rescales S_t first), plus Σ w_m and, for RDA, Σ w_m·‖Δ_m,t‖ in float64. Then the mean
    is S_t·r_t / Σ w and RDA is (Σ w‖Δ‖ / Σ w)·S_t/‖S_t‖. Zero-norm Δs carry no direction and are
    skipped by RDA; weight-0 Δs count only while every weight so far is 0 (then all weigh 1: the
    rounds' fallback). Every chunk is computed the same way on any thread: the same bits for any
    number of workers.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], use_rda: Sequence[bool], workers: Workers = SERIAL):
        self.shapes, self.use_rda, self.workers = [tuple(s) for s in shapes], list(use_rda), workers
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.items = chunks(self.sizes)
        T = len(self.sizes)
        self.sums: list[np.ndarray] | None = None  # allocated at the first add
        self.ref = np.zeros(T)  # r_t; 0: S_t holds nothing yet
        self.w_sum = np.zeros(T)
        self.norm_sum = np.zeros(T)
        self.count = 0
        self.equal = True  # no positive weight seen yet: weight-0 Δs fold with weight 1

    def add(self, delta: Sequence[np.ndarray], weight: float, sum_squares_t: Sequence[float] | None = None,
            gain: float = 1.0) -> None:
        """Fold one Δ (its tensors in order, any shape of the right size; or a ``compression.coded.Coded``
        of them, folded straight from its codes) in with ``weight``;
        ``sum_squares_t``: its ‖Δ_t‖² (the checks computed them; None: computed here where RDA needs them).
        ``gain`` (staleness, ``outer.staleness_gains``) scales the Δ's weight in the sums but not in Σ w,
        so a merge of gained Δs is Σ w·g·Δ / Σ w: a round of only stale Δs steps less (docs/method.md)."""
        w = float(weight)
        g = float(gain)
        if not (math.isfinite(g) and 0 <= g <= 1):
            raise ValueError(f"merge: gains must be in [0, 1], got {gain!r}")
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"merge: weights must be finite and non-negative, got {weight!r}")
        coded = getattr(delta, "fold_into", None) is not None
        if coded and any(self.use_rda) and sum_squares_t is None:
            delta, coded = list(delta.materialize().values()), False  # the norms as a list of values gives them
        flats = None if coded else [np.ravel(d) for d in delta]
        sizes = list(delta.sizes) if coded else [f.size for f in flats]
        if sizes != self.sizes:
            raise ValueError(f"merge: Δ of sizes {sizes[:4]}..., expected {self.sizes[:4]}...")
        if w > 0 and self.equal:  # the first positive weight: Δs of weight 0 stop counting
            if self.count:
                self.ref[:], self.w_sum[:], self.norm_sum[:] = 0, 0, 0
            self.equal = False
        elif w == 0:
            if not self.equal:
                self.count += 1
                return
            w = 1.0
        self.count += 1
        if any(self.use_rda) and sum_squares_t is None:
            sum_squares_t = sum_squares(flats, self.workers)
        wg = w if g == 1 else w * g  # the same bits as before when no gain applies
        coef = np.full(len(sizes), wg)
        for t, rda_t in enumerate(self.use_rda):
            if rda_t:
                norm = math.sqrt(sum_squares_t[t])
                coef[t] = wg / norm if norm > 0 else 0.0
                self.norm_sum[t] += wg * norm if norm > 0 else 0.0
            if coef[t] > 0:
                self.w_sum[t] += w
        new_ref = np.maximum(self.ref, coef)
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(coef > 0, coef / new_ref, 0.0).astype(np.float32)
            rescale = np.where(self.ref > 0, self.ref / new_ref, 0.0).astype(np.float32)
        if self.sums is None:
            self.sums = POOL.split(self.sizes)
        sums = self.sums

        def fold(it) -> None:
            t, a, b = it
            if k[t] != 0:
                _scaled_add(sums[t][a:b], rescale[t], flats[t][a:b], k[t])

        if coded:
            delta.fold_into(sums, rescale, k, self.workers)
        else:
            self.workers.map(fold, self.items)
        self.ref = new_ref

    def absorb(self, other: "Accumulator") -> None:
        """Fold another merge's running sums (of the same tensors) into this one, as if its Δs had
        been added here one by one (up to float32 rounding); ``other`` is spent."""
        if other.count == 0:
            return
        if other.equal and not self.equal:  # weight-0 Δs among weighted ones count, add nothing
            self.count += other.count
            return
        if self.equal and not other.equal and self.count:  # the same switch as ``add``'s
            self.ref[:], self.w_sum[:], self.norm_sum[:] = 0, 0, 0
        self.equal = self.equal and other.equal
        if self.sums is None:
            self.sums = POOL.split(self.sizes)
        new_ref = np.maximum(self.ref, other.ref)
        with np.errstate(divide="ignore", invalid="ignore"):
            mine = np.where(self.ref > 0, self.ref / new_ref, 0.0).astype(np.float32)
            theirs = np.where(other.ref > 0, other.ref / new_ref, 0.0).astype(np.float32)
        sums, extra = self.sums, other.sums

        def fold(it) -> None:
            t, a, b = it
            if theirs[t] != 0:
                _scaled_add(sums[t][a:b], mine[t], extra[t][a:b], theirs[t])

        self.workers.map(fold, self.items)
        self.ref, self.count = new_ref, self.count + other.count
        self.w_sum += other.w_sum
        self.norm_sum += other.norm_sum
        other.sums, other.count = None, 0

    def result(self) -> list[np.ndarray]:
        """The merge, one float32 array per tensor (in place over the sums: call once)."""
        if self.count == 0:
            raise ValueError("merge: no contributions")
        sums = self.sums
        T = len(self.sizes)
        out = [np.zeros(n, np.float32) if self.ref[t] == 0 else sums[t] for t, n in enumerate(self.sizes)]
        factor = np.zeros(T)
        rda = [it for it in self.items if self.use_rda[it[0]] and self.ref[it[0]] > 0]
        dsq = per_tensor(T, rda, self.workers.map(lambda it: chunk_sum_squares(out[it[0]][it[1]:it[2]]), rda))
        for t in range(T):
            if self.ref[t] == 0:
                continue
            if self.use_rda[t]:
                factor[t] = self.norm_sum[t] / self.w_sum[t] / math.sqrt(dsq[t]) if dsq[t] > 0 else 0.0
            else:
                factor[t] = self.ref[t] / self.w_sum[t]
        f32 = factor.astype(np.float32)

        def scale(it) -> None:
            t, a, b = it
            out[t][a:b] *= f32[t]

        self.workers.map(scale, [it for it in self.items if self.ref[it[0]] > 0 and f32[it[0]] != 1])
        self.sums = None
        return [o.reshape(s) for o, s in zip(out, self.shapes)]


def merge_tensors(deltas: Sequence[Sequence[np.ndarray]], weights, use_rda: Sequence[bool],
                  workers: Workers = SERIAL) -> list[np.ndarray]:
    """Merge ``deltas[m][t]`` (learner m's Δ of tensor t) into one float32 array per tensor:
    RDA where ``use_rda[t]``, else the weighted mean Σ w_m Δ_m / Σ w_m (``Accumulator``).

    RDA: Δ = (Σ w‖Δ_m‖ / Σ w) · unit(Σ w·unit(Δ_m)); zero-norm Δ_m are skipped (they carry no
    direction); all-zero input, or directions that cancel exactly, give zeros.
    """
    w = _check_weights(len(deltas), weights)
    acc = Accumulator([np.shape(d) for d in deltas[0]], use_rda, workers)
    for d, wm in zip(deltas, w):
        acc.add(d, wm)
    return acc.result()


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
