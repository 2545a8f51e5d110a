"""Error feedback: carry what quantization dropped into the next send.

One :class:`ErrorFeedback` belongs to one learner and holds a residual per
fragment. Before encoding, ``compensate`` adds the fragment's residual to the
fresh outer gradient; after encoding, ``update`` stores
``compensated - decoded``. Summed over rounds, the decoded updates then equal
the true ones minus only the latest residual, so quantization error does not
accumulate. State is plain float32 numpy arrays keyed by flat names (see
``state_dict``), checkpointable without pickle.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class ErrorFeedback:
    """Per-fragment quantization residuals of one learner; ``enabled=False`` is a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._residuals: dict[int, dict[str, np.ndarray]] = {}

    def compensate(self, fragment_id: int, delta: Mapping[str, Any]) -> dict[str, Any]:
        """``delta + residual`` per tensor (``delta`` unchanged if there is no residual)."""
        res = self._residuals.get(fragment_id) if self.enabled else None
        if res is None:
            return dict(delta)
        _check_like(res, delta, f"fragment {fragment_id}: delta")
        return {name: x + res[name] for name, x in delta.items()}

    def update(self, fragment_id: int, sent: Mapping[str, Any], decoded: Mapping[str, Any]) -> None:
        """Store ``sent - decoded``: ``sent`` is what was encoded (the compensated delta)."""
        if not self.enabled:
            return
        _check_like(sent, decoded, f"fragment {fragment_id}: decoded")
        # Compute everything before storing, so a failure leaves the state as it was.
        new = {name: np.asarray(x, np.float32) - np.asarray(decoded[name], np.float32)
               for name, x in sent.items()}
        self._residuals[fragment_id] = new

    def keep(self, fragment_id: int, residual: Mapping[str, np.ndarray]) -> None:
        """Store a residual computed elsewhere (``FragmentCodec.roundtrip_delta``: ``update``'s
        ``sent - decoded``, fused with the encode)."""
        if self.enabled:
            self._residuals[fragment_id] = {name: np.asarray(x, np.float32) for name, x in residual.items()}

    def residual(self, fragment_id: int) -> dict[str, np.ndarray] | None:
        """The stored residual of a fragment, or None."""
        return self._residuals.get(fragment_id)

    def reset(self, fragment_id: int | None = None) -> None:
        """Forget one fragment's residual, or all of them."""
        if fragment_id is None:
            self._residuals.clear()
        else:
            self._residuals.pop(fragment_id, None)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat ``{"<fragment_id>/<tensor name>": array}`` view of the state."""
        return {f"{p}/{name}": arr for p, res in sorted(self._residuals.items())
                for name, arr in res.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the state with one produced by :meth:`state_dict`."""
        loaded: dict[int, dict[str, np.ndarray]] = {}
        for key, arr in state.items():
            head, sep, name = key.partition("/")
            if not (sep and name and head.lstrip("-").isdigit()):
                raise ValueError(f"error feedback state key {key!r}: expected '<fragment id>/<name>'")
            a = np.asarray(arr)
            if a.dtype != np.float32:
                raise ValueError(f"error feedback state {key!r}: dtype {a.dtype}, expected float32")
            loaded.setdefault(int(head), {})[name] = a.copy()
        self._residuals = loaded


def _check_like(ref: Mapping[str, Any], other: Mapping[str, Any], what: str) -> None:
    if set(ref) != set(other):
        missing = sorted(set(ref) - set(other))[:3]
        extra = sorted(set(other) - set(ref))[:3]
        raise ValueError(f"{what}: tensor names differ (missing {missing}, unexpected {extra})")
    for name, x in ref.items():
        if np.shape(x) != np.shape(other[name]):
            raise ValueError(f"{what}: tensor {name!r} has shape {np.shape(other[name])}, "
                             f"expected {np.shape(x)}")
