"""What the syncer and every learner derive identically from the config: initial parameters and fragments."""
from __future__ import annotations

import hashlib
from typing import Mapping

import jax
import numpy as np

from wan_diloco import model as model_lib
from wan_diloco import tree
from wan_diloco.fragments import make_fragments
from wan_diloco.runtime.config import RuntimeConfig
from wan_diloco.runtime.wire import Layout


def initial_params(cfg: RuntimeConfig) -> dict:
    """The shared starting point Θ(0): same seed, same parameters in every process."""
    return model_lib.init_params(cfg.model, jax.random.PRNGKey(cfg.run.seed))


def fragments_of(cfg: RuntimeConfig, flat: Mapping[str, np.ndarray]) -> list[tuple[str, ...]]:
    sizes = {n: int(a.size) for n, a in flat.items()}
    return make_fragments(cfg.run.fragmenter, sizes, cfg.learner.num_fragments, model_lib.layer_index)


def host_flat(params) -> dict[str, np.ndarray]:
    return {n: np.asarray(a, dtype=np.float32) for n, a in tree.flatten(params).items()}


def layout_of(cfg: RuntimeConfig, flat: Mapping[str, np.ndarray]) -> Layout:
    return Layout(fragments_of(cfg, flat), {n: a.shape for n, a in flat.items()})


def fragment_digest(values: Mapping[str, np.ndarray], names: tuple[str, ...]) -> str:
    """SHA-256 of a fragment's float32 bytes in name order: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(np.ascontiguousarray(values[n], dtype="<f4").tobytes())
    return h.hexdigest()
