"""Pytrees (train states, optimizer states) as named tensors and back, checked against a template."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from wan_diloco import tree

from .format import CheckpointError


def tree_tensors(t: Any, prefix: str) -> dict[str, np.ndarray]:
    """Host copies of every leaf of ``t``, named ``prefix/<flat name>`` (``tree.flatten``)."""
    return {f"{prefix}/{n}" if n else prefix: np.array(v) for n, v in tree.flatten(t).items()}


def restore_tree(tensors: Mapping[str, np.ndarray], prefix: str, like: Any, what: str) -> Any:
    """The pytree ``like`` with its leaves from ``tensors[prefix/...]``; names, shapes and dtypes must match."""
    want = tree.flatten(like)
    got = {}
    for n, leaf in want.items():
        key = f"{prefix}/{n}" if n else prefix
        if key not in tensors:
            raise CheckpointError(f"{what}: tensor {key!r} missing")
        a = tensors[key]
        shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if a.shape != shape or a.dtype != dtype:
            raise CheckpointError(f"{what}: {key!r} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}")
        got[n] = a
    extra = sorted(k for k in tensors if k.startswith(prefix + "/") and k[len(prefix) + 1:] not in want)
    if extra:
        raise CheckpointError(f"{what}: unexpected tensors {extra[:3]} (a different model or optimizer?)")
    return tree.unflatten(got, like)
