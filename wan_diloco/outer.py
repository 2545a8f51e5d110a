"""Outer optimizer (docs/method.md, "Syncer loop"): optax Nesterov SGD on pseudo-gradients, per fragment."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from wan_diloco.config import require


@dataclass(frozen=True)
class OuterConfig:
    """DiLoCo published lr 0.7 / momentum 0.9 and Streaming DiLoCo lr 0.4; these defaults were
    tuned on the tiny preset at 1–2M tokens (docs/quality.md), where 0.7 / 0.9 ended 19–27 %
    above data parallel."""

    lr: float = 0.4
    momentum: float = 0.6
    nesterov: bool = True

    def validate(self) -> None:
        require(0 < self.lr < float("inf"), "lr", f"must be a finite number > 0, got {self.lr}")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")


def make_outer_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0)


class OuterOptimizer:
    """Holds one optax state per fragment; ``step`` applies a merged Δ to Θ_p.

    The pseudo-gradient Δ = Θ − θ points like a gradient, so Θ ← Θ + update(Δ).
    """

    def __init__(self, cfg: OuterConfig, fragments: Mapping[int, Mapping[str, np.ndarray]]):
        self.cfg = cfg
        self.tx = make_outer_optimizer(cfg)
        self.states: dict[int, Any] = {p: self.tx.init(dict(params)) for p, params in fragments.items()}
        tx = self.tx

        @jax.jit
        def _step(params, delta, state):
            updates, state = tx.update(delta, state, params)
            return optax.apply_updates(params, updates), state

        self._step = _step

    def warm_up(self, p: int, params: Mapping[str, np.ndarray]) -> None:
        """Compile the step for fragment p's shapes (the result is discarded)."""
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        jax.block_until_ready(self._step(dict(params), zeros, self.states[p]))

    def step(self, p: int, params: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the new Θ_p (float32 numpy) and advance fragment p's momentum."""
        new, self.states[p] = self._step(dict(params), {k: jnp.asarray(v) for k, v in delta.items()}, self.states[p])
        return {k: np.asarray(v, dtype=np.float32) for k, v in new.items()}
