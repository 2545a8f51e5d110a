"""Outer optimizer (docs/method.md, "Syncer loop"): Nesterov SGD on pseudo-gradients, per fragment.

The math is optax.sgd(lr, momentum, nesterov) computed in place in numpy: the jitted optax step
copied every tensor numpy -> jax -> numpy and took ~5x longer on the syncer's CPU. The state
stays optax's own pytree (``TraceState`` in a chain), so snapshots keep their tensor names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
import optax

from wan_diloco.config import require
from wan_diloco.merge import SERIAL, Workers, chunks


MAX_LR = 10.0  # outer learning rate bound (``OuterConfig.validate``)


@dataclass(frozen=True)
class OuterConfig:
    """DiLoCo published lr 0.7 / momentum 0.9 and Streaming DiLoCo lr 0.4; these defaults were
    tuned on the tiny preset at 1–2M tokens (docs/quality.md), where 0.7 / 0.9 ended 19–27 %
    above data parallel."""

    lr: float = 0.4
    momentum: float = 0.6
    nesterov: bool = True

    def validate(self) -> None:
        # Published outer lrs are 0.4-1.0; past MAX_LR one outer step moves Θ by many times the merged
        # Δ (and 1e300 is -inf in float32): every merge would then be refused as non-finite, or worse.
        require(isinstance(self.lr, (int, float)) and 0 < self.lr <= MAX_LR, "lr",
                f"must be a number in (0, {MAX_LR:g}], got {self.lr}")
        require(isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1, "momentum",
                f"must be in [0, 1), got {self.momentum}")
        require(isinstance(self.nesterov, bool), "nesterov", f"must be true or false, got {self.nesterov!r}")


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
        self.states[p] = jax.tree.map(lambda a: np.array(a, dtype=np.float32), state)

    def _trace(self, p: int) -> Mapping[str, np.ndarray] | None:
        return self.states[p][0].trace if self._mu is not None else None

    def update(self, p: int, delta: Mapping[str, np.ndarray], workers: Workers = SERIAL) -> dict[str, np.ndarray]:
        """The update of fragment p for ``delta`` (float32, fresh arrays); its momentum is untouched
        until ``commit``, so a refused merge leaves it as it was."""
        names = list(delta)
        g = [np.ravel(delta[n]) for n in names]
        trace = self._trace(p)
        t = None if trace is None else [np.ravel(trace[n]) for n in names]
        out = [np.empty(x.size, np.float32) for x in g]

        def run(it) -> None:
            i, a, b = it
            u, gi = out[i][a:b], g[i][a:b]
            if t is None:
                np.multiply(gi, self._neg_lr, out=u)
                return
            np.multiply(t[i][a:b], self._mu, out=u)  # the new trace: g + mu * trace
            u += gi
            if self._nesterov:
                u *= self._mu
                u += gi
            u *= self._neg_lr

        workers.map(run, chunks([x.size for x in g]))
        return {n: u.reshape(np.shape(delta[n])) for n, u in zip(names, out)}

    def commit(self, p: int, delta: Mapping[str, np.ndarray], workers: Workers = SERIAL) -> None:
        """Advance fragment p's momentum by ``delta`` (the one ``update`` saw), in place."""
        trace = self._trace(p)
        if trace is None:
            return
        names = list(delta)
        g = [np.ravel(delta[n]) for n in names]
        t = [trace[n].reshape(-1) for n in names]  # views: the arrays are ours (``set_state``)

        def run(it) -> None:
            i, a, b = it
            ti = t[i][a:b]
            ti *= self._mu
            ti += g[i][a:b]

        workers.map(run, chunks([x.size for x in g]))

    def step(self, p: int, params: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the new Θ_p (float32) and advance fragment p's momentum."""
        u = self.update(p, delta)
        self.commit(p, delta)
        return {n: np.add(params[n], u[n], dtype=np.float32) for n in u}
