"""Outer optimizer (docs/method.md, "Syncer loop"): Nesterov SGD on pseudo-gradients, per fragment.

The math is optax.sgd(lr, momentum, nesterov) computed in place in numpy: the jitted optax step
copied every tensor numpy -> jax -> numpy and took ~5x longer on the syncer's CPU. The state
stays optax's own pytree (``TraceState`` in a chain), so snapshots keep their tensor names.
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import optax

from wan_diloco import kernels
from wan_diloco.buffers import POOL, pooled_copy, thread_scratch
from wan_diloco.config import require
from wan_diloco.merge import SERIAL, Workers, chunks


# Below this, |Θ_p| + |update| cannot reach float32's largest value: Θ_p + update cannot overflow.
NO_OVERFLOW = float(np.finfo(np.float32).max) / 4
MAX_LR = 10.0  # outer learning rate bound (``OuterConfig.validate``)
STALENESS = ("none", "scale", "gate")  # ``OuterConfig.staleness``
MAX_STALENESS_POWER = 8.0  # past it a Δ one version old weighs < 0.4 % of a fresh one: dropping it says so better


@dataclass(frozen=True)
class OuterConfig:
    """DiLoCo published lr 0.7 / momentum 0.9 and Streaming DiLoCo lr 0.4; these defaults were
    tuned on the tiny preset at 1–2M tokens (docs/quality.md), where 0.7 / 0.9 ended 19–27 %
    above data parallel."""

    lr: float = 0.4
    momentum: float = 0.6
    nesterov: bool = True
    # Beyond the paper (docs/method.md, "Staleness-aware outer steps"): a Δ based s versions before the
    # fragment's current one weighs g = (1+s)^-power ("scale"), or that only as far as it points against
    # the momentum ("gate": g = (1+s)^(-power * max(0, -cos))). "none": every Δ weighs its tokens alone.
    staleness: str = "none"
    staleness_power: float = 1.0

    def validate(self) -> None:
        # Published outer lrs are 0.4-1.0; past MAX_LR one outer step moves Θ by many times the merged
        # Δ (and 1e300 is -inf in float32): every merge would then be refused as non-finite, or worse.
        require(isinstance(self.lr, (int, float)) and 0 < self.lr <= MAX_LR, "lr",
                f"must be a number in (0, {MAX_LR:g}], got {self.lr}")
        require(isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1, "momentum",
                f"must be in [0, 1), got {self.momentum}")
        require(isinstance(self.nesterov, bool), "nesterov", f"must be true or false, got {self.nesterov!r}")
        require(self.staleness in STALENESS, "staleness", f"must be one of {', '.join(STALENESS)}, got {self.staleness!r}")
        p = self.staleness_power
        require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= MAX_STALENESS_POWER,
                "staleness_power", f"must be a number in (0, {MAX_STALENESS_POWER:g}], got {p!r}")
        # The gate compares a Δ with the momentum: without momentum there is nothing to compare with.
        require(self.staleness != "gate" or self.momentum > 0, "staleness",
                f'"gate" needs momentum > 0 (it gates by the cosine with the momentum), got momentum {self.momentum}')


def staleness_gains(cfg: OuterConfig, staleness: Sequence[int], cosines: Sequence[float] | None = None) -> np.ndarray | None:
    """Each contribution's gain g_m in [0, 1] for its staleness s_m (versions; docs/method.md), or None
    where every gain is 1 (no option, or no stale Δ): the merge then runs exactly as without the option.
    ``cosines`` (cos(Δ_m, momentum), "gate" only) are read for stale contributions alone."""
    s = np.asarray(staleness, dtype=np.float64)
    if cfg.staleness == "none" or not (s > 0).any():
        return None
    power = np.full(s.shape, float(cfg.staleness_power))
    if cfg.staleness == "gate":
        power *= np.maximum(0.0, -np.asarray(cosines, dtype=np.float64))
    return np.where(s > 0, (1.0 + np.maximum(s, 0.0)) ** -power, 1.0)


def cosine(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """cos between two fragments' tensors taken as one vector (float64 sums); 0 where either is zero."""
    dot = na = nb = 0.0
    for n in a:
        x, y = np.ravel(a[n]).astype(np.float64), np.ravel(b[n]).astype(np.float64)
        dot, na, nb = dot + float(x @ y), na + float(x @ x), nb + float(y @ y)
    return dot / math.sqrt(na * nb) if na > 0 and nb > 0 else 0.0


def make_outer_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    """The optax transformation ``OuterOptimizer`` reproduces (its state layout, and the reference in tests)."""
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0)


class OuterOptimizer:
    """Holds one optax-shaped state per fragment; ``update`` + ``commit`` (or ``step``) apply a merged Δ.

    The pseudo-gradient Δ = Θ − θ points like a gradient, so Θ ← Θ + update(Δ). optax's formulas,
    in float32 with the same operation order (so the same bits, up to XLA's own fusions):
    trace ← Δ + μ·trace; update = −lr·(Δ + μ·trace) with Nesterov, −lr·trace without, −lr·Δ for μ = 0.
    """

    def __init__(self, cfg: OuterConfig, fragments: Mapping[int, Mapping[str, np.ndarray]]):
        self.cfg = cfg
        self.tx = make_outer_optimizer(cfg)
        self._mu = np.float32(cfg.momentum) if cfg.momentum > 0 else None
        self._neg_lr = np.float32(-cfg.lr)
        self._nesterov = cfg.nesterov and cfg.momentum > 0
        self.states: dict[int, Any] = {}
        for p, params in fragments.items():
            self.set_state(p, self.tx.init({n: np.zeros(np.shape(a), np.float32) for n, a in params.items()}))

    def set_state(self, p: int, state: Any) -> None:
        """Adopt ``state`` (optax's pytree, e.g. from a snapshot) as writable host copies: ``commit``
        writes into them, and a snapshot's arrays may be read-only or shared."""
        trace = state[0].trace if self._mu is not None and hasattr(state[0], "trace") else None
        if isinstance(trace, Mapping):  # copied into the pool: a close lets its arrays go for the next round's sums
            pooled = pooled_copy(trace)
            state = (state[0]._replace(trace={}),) + tuple(state[1:])  # copied once, not twice
            self.states[p] = jax.tree.map(lambda a: np.array(a, dtype=np.float32), state)
            self.states[p][0].trace.update(pooled)
            return
        self.states[p] = jax.tree.map(lambda a: np.array(a, dtype=np.float32), state)

    def _trace(self, p: int) -> Mapping[str, np.ndarray] | None:
        return self.states[p][0].trace if self._mu is not None else None

    def update(self, p: int, delta: Mapping[str, np.ndarray], workers: Workers = SERIAL) -> dict[str, np.ndarray]:
        """The update of fragment p for ``delta`` (float32, in arrays of ``buffers.POOL``); its momentum is untouched
        until ``commit``, so a refused merge leaves it as it was."""
        names = list(delta)
        g = [np.ravel(np.asarray(delta[n], np.float32)) for n in names]  # the loops take float32
        trace = self._trace(p)
        t = None if trace is None else [np.ravel(trace[n]) for n in names]
        out = POOL.split([x.size for x in g])

        def run(it) -> None:
            i, a, b = it
            u, gi = out[i][a:b], g[i][a:b]
            if t is None:
                np.multiply(gi, self._neg_lr, out=u)
                return
            kernels.outer_update(t[i][a:b], gi, self._mu, self._neg_lr, self._nesterov, u)

        workers.map(run, chunks([x.size for x in g]))
        return {n: u.reshape(np.shape(delta[n])) for n, u in zip(names, out)}

    def commit(self, p: int, delta: Mapping[str, np.ndarray], workers: Workers = SERIAL) -> None:
        """Advance fragment p's momentum by ``delta`` (the one ``update`` saw), in place."""
        trace = self._trace(p)
        if trace is None:
            return
        names = list(delta)
        g = [np.ravel(np.asarray(delta[n], np.float32)) for n in names]  # the loops take float32
        t = [trace[n].reshape(-1) for n in names]  # views: the arrays are ours (``set_state``)

        def run(it) -> None:
            i, a, b = it
            kernels.momentum_commit(t[i][a:b], g[i][a:b], self._mu)

        workers.map(run, chunks([x.size for x in g]))

    def step_streamed(self, p: int, theta: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], encode,
                      theta_sq: float | None) -> tuple[dict[str, np.ndarray], Any] | None:
        """The outer step of fragment p without an update array: (the new Θ_p, what ``encode`` returned), or
        None where ``encode`` cannot (nothing changed then). ``encode(produce, base, out, bound_ok)`` is a
        codec's ``roundtrip_streamed``: each work item's update is made into a thread's scratch
        (``kernels.outer_advance``: the update as ``update`` makes it, the new momentum written over the
        merged Δ), encoded, and once every item passed, decoded and added to Θ_p (as ``numpy.add``). The new
        Θ_p goes into the old momentum's arrays (or, without momentum, the merged Δ's): Θ_p's own arrays are
        never written (a snapshot may share them). ``delta``: float32 writable arrays, spent whatever
        happens. ValueError where the encoder refuses the update or Θ_p + update overflows (checked first
        by a pass of its own only where ``theta_sq``, ‖Θ_p‖², and the update's scales leave it possible):
        Θ_p and the momentum are then as they were."""
        names = list(delta)
        g = [np.ravel(delta[n]) for n in names]
        if not all(x.dtype == np.float32 and x.flags.writeable and x.flags.c_contiguous for x in g):
            return None
        th = [np.ravel(np.asarray(theta[n], np.float32)) for n in names]
        trace = self._trace(p)
        t = None if trace is None else [trace[n].reshape(-1) for n in names]
        mu, neg_lr, nesterov = self._mu, self._neg_lr, self._nesterov

        def produce(i: int, lo: int, hi: int) -> np.ndarray:
            u = thread_scratch(hi - lo)
            if t is None:
                np.multiply(g[i][lo:hi], neg_lr, out=u)
            else:
                kernels.outer_advance(t[i][lo:hi], g[i][lo:hi], mu, neg_lr, nesterov, u)
            return u

        def bound_ok(largest: float) -> bool:
            return theta_sq is not None and math.sqrt(theta_sq) + largest < NO_OVERFLOW

        dest = g if t is None else t
        enc = encode(produce, th, dest, bound_ok)
        if enc is None:
            return None
        if trace is not None:
            for n, x in zip(names, g):
                trace[n] = x.reshape(np.shape(trace[n]))
        return {n: x.reshape(np.shape(delta[n])) for n, x in zip(names, dest)}, enc

    def gains(self, p: int, staleness: Sequence[int], deltas: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray | None:
        """``staleness_gains`` of fragment p's contributions ``deltas`` (the gate's cosines against p's
        momentum computed only for the stale ones, and only with "gate")."""
        trace = self._trace(p)
        cos = None
        if self.cfg.staleness == "gate" and trace is not None:
            cos = [cosine(d, trace) if s > 0 else 0.0 for s, d in zip(staleness, deltas)]
        return staleness_gains(self.cfg, staleness, cos)

    def step(self, p: int, params: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the new Θ_p (float32) and advance fragment p's momentum."""
        u = self.update(p, delta)
        self.commit(p, delta)
        return {n: np.add(params[n], u[n], dtype=np.float32) for n in u}
