"""Flat views of parameter pytrees.

Fragments, merges, codecs and checkpoints all address tensors by a flat name:
the flax path joined with "/" (for example ``block_3/attn/qkv/kernel``).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree: Any) -> dict[str, Any]:
    """Pytree -> {"a/b/c": leaf}, in the tree's own deterministic leaf order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def unflatten(flat: Mapping[str, Any], like: Any) -> Any:
    """Inverse of :func:`flatten`: put ``flat``'s leaves into the structure of ``like``."""
    names = list(flatten(like))
    missing = [n for n in names if n not in flat]
    extra = [n for n in flat if n not in set(names)]
    if missing or extra:
        raise KeyError(f"tensor names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    treedef = jax.tree_util.tree_structure(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])


def to_named(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    """Host copies of every leaf of ``tree`` (an optimizer state, say), named ``prefix/<flat name>``."""
    return {f"{prefix}/{n}" if n else prefix: np.array(v) for n, v in flatten(tree).items()}


def from_named(tensors: Mapping[str, np.ndarray], prefix: str, like: Any, what: str) -> Any:
    """Inverse of :func:`to_named` into the structure of ``like``; ValueError names the first tensor
    whose name, shape or dtype differs (a different model or optimizer)."""
    want = flatten(like)
    got = {}
    for n, leaf in want.items():
        key = f"{prefix}/{n}" if n else prefix
        if key not in tensors:
            raise ValueError(f"{what}: tensor {key!r} missing")
        a = tensors[key]
        shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(f"{what}: {key!r} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}")
        got[n] = a
    extra = sorted(k for k in tensors if k.startswith(prefix + "/") and k[len(prefix) + 1:] not in want)
    if extra:
        raise ValueError(f"{what}: unexpected tensors {extra[:3]} (a different model or optimizer?)")
    return unflatten(got, like)
