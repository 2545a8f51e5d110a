"""The trained model's parameters as a plain safetensors file other frameworks can read too.

Tensor names are the flat flax paths (``tree.flatten``, e.g. ``block_0/attn/qkv/kernel``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from wan_diloco import tree

from .format import CheckpointError, load_state, save_state

KIND = "params"


def save_params(path: str | Path, params: Any, info: Mapping[str, Any] | None = None) -> int:
    """Write a parameter pytree (or an already flat name -> array mapping); returns bytes written."""
    flat = dict(params) if isinstance(params, Mapping) and all(
        isinstance(v, np.ndarray) for v in params.values()) else tree.flatten(params)
    return save_state(path, {n: np.asarray(v) for n, v in flat.items()}, dict(info or {}), KIND)


def load_params(path: str | Path, like: Any = None) -> Any:
    """The parameters in a file written by a run (``RUN_DIR/checkpoints/params.safetensors``): a flat
    name -> numpy array dict, or ``like``'s structure given a template pytree (:func:`read_params`,
    without the info)."""
    return read_params(path, like)[0]


def read_params(path: str | Path, like: Any = None) -> tuple[Any, dict[str, Any]]:
    """(parameters, info) from a file written by a run (``RUN_DIR/checkpoints/params.safetensors``).

    Without ``like`` the parameters are a flat name -> numpy array dict; with a
    template pytree (e.g. ``model.init_params(cfg, key)``) they come back in its
    structure, after checking every name and shape. ``info`` holds the run id,
    the fragment versions and the model config the file was written with.
    """
    flat, info = load_state(path, KIND)
    if like is None:
        return flat, info
    want = tree.flatten(like)
    for n, leaf in want.items():
        if n not in flat:
            raise CheckpointError(f"{path}: tensor {n!r} missing (a different model?)")
        if flat[n].shape != tuple(np.shape(leaf)):
            raise CheckpointError(f"{path}: {n!r} has shape {list(flat[n].shape)}, expected {list(np.shape(leaf))}")
    extra = sorted(set(flat) - set(want))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:3]} (a different model?)")
    return tree.unflatten(flat, like), info


def join_params(parts: list[Path], out: Path) -> Path:
    """One parameter file from files holding disjoint tensors of one model (the syncer shards' finals):
    their tensors together, and the first file's info with every file's fragment digests."""
    flat: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {}
    for path in parts:
        tensors, part_info = read_params(path)
        twice = sorted(set(tensors) & set(flat))
        if twice:
            raise CheckpointError(f"{path}: tensor {twice[0]!r} is in another part too (not one model's shards?)")
        flat.update(tensors)
        if not info:
            info = {k: v for k, v in part_info.items() if k not in ("shard", "owned")}
        digests = info.get("digests")
        for p, d in enumerate(part_info.get("digests") or []):
            if d is not None and digests is not None and p < len(digests):
                digests[p] = d
    save_params(out, flat, info)
    return out
