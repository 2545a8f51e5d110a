"""Flat views of parameter pytrees.

Fragments, merges, codecs and checkpoints all address tensors by a flat name:
the flax path joined with "/" (for example ``block_3/attn/qkv/kernel``).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax


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
