"""Merging learners' outer gradients (docs/method.md, "Merging"): token weights, weighted mean, RDA.

Outer gradients of different learners are nearly orthogonal, so a plain mean
shrinks like 1/sqrt(M); radial-directional averaging (RDA) averages norm and
direction separately so the merged norm is the weighted mean norm for any M.
"""
from __future__ import annotations

from typing import Callable, Literal, Mapping, Sequence

import numpy as np

MergeMethod = Literal["rda", "mean"]


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


def _check(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if len(deltas) == 0 or len(deltas) != len(w):
        raise ValueError(f"merge: {len(deltas)} deltas but {len(w)} weights")
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"merge: weights must be finite, non-negative and not all zero, got {w.tolist()}")
    shape = deltas[0].shape
    for d in deltas[1:]:
        if d.shape != shape:
            raise ValueError(f"merge: shape mismatch {d.shape} vs {shape}")
    return w


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Σ w_m Δ_m / Σ w_m (in float64, returned as float32)."""
    w = _check(deltas, np.asarray(weights))
    acc = np.zeros(deltas[0].shape, dtype=np.float64)
    for wm, d in zip(w, deltas):
        acc += wm * d
    return (acc / w.sum()).astype(np.float32)


def _norm(x: np.ndarray) -> float:
    """‖x‖ accumulated in float64 without BLAS: a BLAS dot spins up its threads, which on a few
    cores shared with XLA's made the norms of one merge cost more than the training step."""
    x = x.ravel()
    return float(np.sqrt(np.einsum("i,i->", x, x, dtype=np.float64)))


def rda(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional average of one tensor's outer gradients.

    Δ = (Σ w‖Δ_m‖ / Σ w) · unit(Σ w·unit(Δ_m) / Σ w); zero-norm Δ_m are skipped
    (they carry no direction). All-zero input returns zeros.
    """
    w = _check(deltas, np.asarray(weights))
    norms = np.array([_norm(d) for d in deltas])
    keep = (norms > 0) & (w > 0)
    if not keep.any():
        return np.zeros(deltas[0].shape, dtype=np.float32)
    wk, nk = w[keep], norms[keep]
    mean_norm = float((wk * nk).sum() / wk.sum())
    direction = np.zeros(deltas[0].shape, dtype=np.float64)
    for wm, nm, d in zip(wk, nk, (d for d, k in zip(deltas, keep) if k)):
        direction += (wm / nm) * d
    dnorm = _norm(direction)
    if dnorm == 0:  # exactly opposite directions cancel: no consensus, no step
        return np.zeros(deltas[0].shape, dtype=np.float32)
    return (direction * (mean_norm / dnorm)).astype(np.float32)


def merge_fragment(
    contributions: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    method: MergeMethod,
    is_embedding: Callable[[str], bool],
) -> dict[str, np.ndarray]:
    """Merge per-learner fragments {name: Δ}: RDA per tensor (or mean), embeddings by mean."""
    if not contributions:
        raise ValueError("merge: no contributions")
    names = list(contributions[0])
    for c in contributions[1:]:
        if list(c) != names:
            raise ValueError(f"merge: contributions name different tensors: {sorted(set(c) ^ set(names))[:3]}")
    out = {}
    for name in names:
        ds = [np.asarray(c[name]) for c in contributions]
        use_rda = method == "rda" and not is_embedding(name)
        out[name] = rda(ds, weights) if use_rda else weighted_mean(ds, weights)
    return out
