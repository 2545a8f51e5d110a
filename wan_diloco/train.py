"""The inner step: AdamW on one learner, data parallel over its devices.

``make_train_step`` returns a pure jitted ``(state, tokens) -> (state,
metrics)``: the batch is split along the mesh axis ``"data"``, parameters and
optimizer state are replicated, and XLA inserts the gradient all-reduce. The
mesh may span the processes of a multi-host learner (``runtime.multihost``);
the same functions then run in every process, each given the global batch as
one sharded array (``multihost.global_batch``). A host array works there too,
but must be the same on every process, which JAX checks with a collective on
each call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wan_diloco import model as model_lib
from wan_diloco.config import ConfigError, require
from wan_diloco.model import ModelConfig, Params

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Inner optimizer: AdamW, linear warmup then cosine decay, global-norm clipping."""

    lr: float = 3e-3  # peak learning rate; suits the tiny preset
    warmup_steps: int = 50  # capped at a tenth of the run by the run spec
    total_steps: int = 5000  # length of the cosine schedule (warmup included)
    weight_decay: float = 0.1  # applied to matrices only, not to norm scales
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio

    def validate(self) -> None:
        require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(self.total_steps > self.warmup_steps, "total_steps",
                f"must exceed warmup_steps={self.warmup_steps}, got {self.total_steps}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(0 <= self.b1 < 1, "b1", f"must be in [0, 1), got {self.b1}")
        require(0 <= self.b2 < 1, "b2", f"must be in [0, 1), got {self.b2}")
        require(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Learning rate as a function of the inner step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warmup + cosine schedule, preceded by global-norm clipping."""
    cfg.validate()
    # Decaying norm scales towards zero would fight the normalization.
    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


@flax.struct.dataclass
class TrainState:
    """Learner state: parameters, inner optimizer state and the local step counter."""

    params: Params
    opt_state: Any
    step: jax.Array  # int32 scalar


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig, key: jax.Array, params: Params | None = None) -> TrainState:
    """Fresh parameters from ``key`` (or the given ``params``) and a zeroed optimizer state."""
    params = model_lib.init_params(model_cfg, key) if params is None else params
    return TrainState(params, make_optimizer(train_cfg).init(params), jnp.zeros((), jnp.int32))


def set_params(state: TrainState, params: Params) -> TrainState:
    """Replace the parameters (e.g. after a global merge), keeping optimizer state and step."""
    return state.replace(params=params)


def _is_sched(x: Any) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def schedule_step(state: TrainState) -> jax.Array:
    """Where the learning-rate schedule is (the local step unless :func:`set_schedule_step` moved it)."""
    return next(x.count for x in jax.tree_util.tree_leaves(state.opt_state, is_leaf=_is_sched) if _is_sched(x))


def set_schedule_step(state: TrainState, step: int) -> TrainState:
    """Put the learning-rate schedule at ``step``, leaving Adam's own count (bias correction) alone.

    A learner's local step count is the wrong clock for a token budget once
    learners drop out: the live ones then take more steps than planned and
    would reach the end of the schedule early. A driver that knows the global
    progress sets the schedule position from it.
    """
    count = jnp.asarray(step, jnp.int32)
    opt_state = jax.tree_util.tree_map(lambda x: x._replace(count=count) if _is_sched(x) else x,
                                       state.opt_state, is_leaf=_is_sched)
    return state.replace(opt_state=opt_state)


def local_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: all local devices)."""
    devices = list(jax.local_devices() if devices is None else devices)
    require(len(devices) > 0, "devices", "need at least one device")
    return Mesh(np.array(devices), (DATA_AXIS,))


def _check_batch(tokens: Any, model_cfg: ModelConfig, mesh: Mesh) -> None:
    shape = getattr(tokens, "shape", ())
    n_dev = mesh.shape[DATA_AXIS]
    if len(shape) != 2 or not 2 <= shape[1] <= model_cfg.seq_len + 1:
        raise ConfigError(f"batch: tokens must have shape (batch_size, seq_len + 1 <= "
                          f"{model_cfg.seq_len + 1}), got {shape}")
    if shape[0] % n_dev:
        raise ConfigError(f"batch_size: {shape[0]} is not divisible by the {n_dev} devices of the "
                          f"'{DATA_AXIS}' mesh axis")


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


@functools.lru_cache(maxsize=32)
def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh,
                    donate: bool = False) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """Jitted ``step(state, tokens_BxLp1) -> (state, {"loss", "grad_norm", "lr"})``.

    ``donate=True`` lets XLA reuse the old state's buffers; the caller must
    then not touch the state it passed in. Calls with equal arguments return
    the same function, so learners sharing a process compile once.
    """
    model_cfg.validate()
    tx = make_optimizer(train_cfg)
    schedule = lr_schedule(train_cfg)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(DATA_AXIS))

    def step(state: TrainState, tokens_BxLp1: jax.Array) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(model_lib.loss_fn)(state.params, model_cfg, tokens_BxLp1)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), "lr": schedule(schedule_step(state))}
        return TrainState(params, opt_state, state.step + 1), metrics

    jitted = jax.jit(step, in_shardings=(replicated, batch_sharding),
                     out_shardings=(replicated, replicated), donate_argnums=(0,) if donate else ())

    def run(state: TrainState, tokens_BxLp1: Any) -> tuple[TrainState, dict]:
        _check_batch(tokens_BxLp1, model_cfg, mesh)
        # Placing the state first keeps one compiled version: fresh or host-merged params would
        # otherwise arrive uncommitted and miss the jit cache (a recompile per distinct mix).
        return jitted(jax.device_put(state, replicated), jax.device_put(tokens_BxLp1, batch_sharding))

    return run


@functools.lru_cache(maxsize=32)
def make_eval_fn(model_cfg: ModelConfig, mesh: Mesh) -> Callable[[Params, Sequence[Any]], float]:
    """``eval(params, batches) -> float``: mean loss over equally sized batches."""
    model_cfg.validate()
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(DATA_AXIS))
    jitted = jax.jit(lambda p, t: model_lib.loss_fn(p, model_cfg, t),
                     in_shardings=(replicated, batch_sharding), out_shardings=replicated)

    def evaluate(params: Params, batches: Sequence[Any]) -> float:
        require(len(batches) > 0, "eval batches", "need at least one batch")
        losses = []
        for tokens in batches:
            _check_batch(tokens, model_cfg, mesh)
            losses.append(jitted(params, jax.device_put(tokens, batch_sharding)))
        return float(jnp.mean(jnp.stack(losses)))

    return evaluate


__all__ = ["DATA_AXIS", "TrainConfig", "TrainState", "init_state", "local_mesh", "lr_schedule",
           "make_eval_fn", "make_optimizer", "make_train_step", "schedule_step", "set_params",
           "set_schedule_step"]
