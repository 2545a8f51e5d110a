"""The model: a built-in decoder-only transformer (flax linen) with size presets, or the user's own
flax module (``[model] module = "package.module:factory"`` or ``"path/to/file.py:factory"``).

Built-in: pre-norm blocks (RMSNorm), causal self-attention with rotary
positions, GELU MLP, final norm and an untied output projection. Parameters
are a plain nested dict of float32 arrays whose flat names
(:func:`wan_diloco.tree.flatten`) look like ``embed/embedding``,
``block_3/attn/qkv/kernel``, ``final_norm/scale``, ``lm_head/kernel``;
fragments and merges address tensors by those names.

A user module is any ``flax.linen.Module`` that maps token ids BxL (int32) to
logits BxLxV; its factory is called with the :class:`ModelConfig` (it may read
``vocab_size`` and ``seq_len``, and ignore the transformer's dimensions). Its
parameters must be float32 and it may hold no other variable collections
(the syncer merges parameters only). Fragments, the codec and the merge work
on any parameter tree.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from wan_diloco.config import ConfigError, require

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Transformer shape. Defaults are the ``tiny`` preset."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128  # maximum context length, in tokens
    # "package.module:factory" or "path/to/file.py:factory": the user's flax module instead of the built-in
    # transformer (whose dimensions are then ignored); "" is the built-in.
    module: str = ""
    # The parameters the run starts from (Θ(0)) instead of fresh ones from run.seed: a safetensors file with
    # the model's tensor names, or a run's folder (its params file). Read by the spec, which makes it absolute.
    init: str = ""

    def validate(self) -> None:
        if self.module:
            where, _, attr = self.module.rpartition(":")
            require(bool(where) and attr.isidentifier(), "module",
                    f"must be 'package.module:factory' or 'path/to/file.py:factory', got {self.module!r}")
            for name in ("vocab_size", "seq_len"):
                require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
            return
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        require(self.d_model % self.n_heads == 0, "n_heads",
                f"must divide d_model={self.d_model}, got {self.n_heads}")
        # Rotary embeddings rotate pairs of channels.
        require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                f"head size d_model/n_heads={self.d_model // self.n_heads} must be even")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # ~33K params: the canonical small run of tests and benchmarks (examples/micro.toml).
    "micro": ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=32),
    # ~0.86M params: trains at CPU speed in tests and simulations.
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=512, seq_len=128),
    # ~10.8M params.
    "small": ModelConfig(d_model=384, n_layers=6, n_heads=6, d_ff=1536, seq_len=256),
    # ~99.5M params (GPT-2-small width, 14 layers).
    "base": ModelConfig(d_model=768, n_layers=14, n_heads=12, d_ff=3072, seq_len=512),
}


def preset(name: str) -> ModelConfig:
    """The named size preset; unknown names raise ConfigError listing the valid ones."""
    require(name in PRESETS, "model.preset",
            f"unknown preset {name!r}; valid presets are {', '.join(PRESETS)}")
    return PRESETS[name]


def _init(stddev: float) -> Any:
    return nn.initializers.normal(stddev=stddev)


def _rope(x_BxLxNxH: jax.Array) -> jax.Array:
    length, head_dim = x_BxLxNxH.shape[1], x_BxLxNxH.shape[3]
    half = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles_LxH = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin = jnp.sin(angles_LxH)[None, :, None, :]
    cos = jnp.cos(angles_LxH)[None, :, None, :]
    x1, x2 = x_BxLxNxH[..., :half], x_BxLxNxH[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class _Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_NxD: jax.Array, length: int) -> jax.Array:
        cfg = self.cfg
        b = x_NxD.shape[0] // length
        qkv = nn.Dense(3 * cfg.d_model, use_bias=False, kernel_init=_init(0.02), name="qkv")(x_NxD)
        q, k, v = jnp.split(qkv.reshape(b, length, 3 * cfg.n_heads, cfg.head_dim), 3, axis=2)
        out = jax.nn.dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        # Residual-branch outputs start small so depth does not blow up the stream.
        out_init = _init(0.02 / math.sqrt(2 * cfg.n_layers))
        return nn.Dense(cfg.d_model, use_bias=False, kernel_init=out_init, name="out")(
            out.reshape(b * length, cfg.d_model))


class _Mlp(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = nn.gelu(nn.Dense(cfg.d_ff, use_bias=False, kernel_init=_init(0.02), name="fc_in")(x_NxD))
        out_init = _init(0.02 / math.sqrt(2 * cfg.n_layers))
        return nn.Dense(cfg.d_model, use_bias=False, kernel_init=out_init, name="fc_out")(h)


class _Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_NxD: jax.Array, length: int) -> jax.Array:
        x = x_NxD + _Attention(self.cfg, name="attn")(nn.RMSNorm(name="attn_norm")(x_NxD), length)
        return x + _Mlp(self.cfg, name="mlp")(nn.RMSNorm(name="mlp_norm")(x))


class Transformer(nn.Module):
    """Token ids BxL -> logits BxLxV."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, length = tokens_BxL.shape
        # The residual stream is kept as N=B*L rows: XLA:CPU runs the backward
        # pass of 2-D matmuls about 3x faster than of batched 3-D ones.
        x = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init(0.02), name="embed")(
            tokens_BxL.reshape(b * length))
        for i in range(cfg.n_layers):
            x = _Block(cfg, name=f"block_{i}")(x, length)
        x = nn.RMSNorm(name="final_norm")(x)
        logits = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=_init(0.02), name="lm_head")(x)
        return logits.reshape(b, length, cfg.vocab_size)


def build(cfg: ModelConfig) -> nn.Module:
    """The flax module of ``cfg``: the built-in transformer, or the user's (``cfg.module``)."""
    if not cfg.module:
        return Transformer(cfg)
    made = _factory(cfg.module)(cfg)
    require(isinstance(made, nn.Module), "model.module",
            f"{cfg.module} returned {type(made).__name__}, not a flax.linen.Module")
    return made


@functools.lru_cache(maxsize=None)
def _factory(ref: str) -> Callable[[ModelConfig], nn.Module]:
    where, _, attr = ref.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            require(path.is_file(), "model.module", f"{where}: no such file")
            # A name of its own per file: two runs' files named model.py must not shadow each other.
            name = f"wan_diloco_user_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclass-based modules look their module up while being defined
            spec.loader.exec_module(mod)
        else:
            # As `python -m` would: the console script does not put the working directory on the path.
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            mod = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's code: whatever it raises is reported, in one line
        raise ConfigError(f"model.module: cannot load {where!r} ({type(e).__name__}: {e}); every process of the "
                          f"run must be able to import it (install it, put its folder on PYTHONPATH, or give a "
                          f".py path)") from e
    fn = getattr(mod, attr, None)
    require(callable(fn), "model.module", f"{where} has no callable {attr!r}")
    return fn


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Fresh float32 parameters: a plain nested dict of arrays."""
    cfg.validate()
    module = build(cfg)
    dummy = jnp.zeros((1, cfg.seq_len), jnp.int32)
    variables = jax.jit(module.init)(key, dummy)
    if cfg.module:
        _check_user_module(cfg, module, variables, dummy)
    return _plain(variables["params"])


def _check_user_module(cfg: ModelConfig, module: nn.Module, variables: Any, dummy: jax.Array) -> None:
    others = sorted(set(variables) - {"params"})
    require(not others, "model.module", f"{cfg.module}: variable collections {others} besides 'params' are not "
                                        f"supported (the syncer merges parameters only)")
    require("params" in variables, "model.module", f"{cfg.module}: the module has no parameters")
    for name, leaf in _flat(variables["params"]):
        require(leaf.dtype == jnp.float32, "model.module",
                f"{cfg.module}: parameter {name} is {leaf.dtype}; parameters must be float32 (compute in another "
                f"dtype inside the module if you like)")
    out = jax.eval_shape(module.apply, variables, dummy)
    want = (1, cfg.seq_len, cfg.vocab_size)
    require(getattr(out, "shape", None) == want and jnp.issubdtype(out.dtype, jnp.floating), "model.module",
            f"{cfg.module}: maps tokens (1, {cfg.seq_len}) to {getattr(out, 'shape', type(out).__name__)}; "
            f"expected float logits of shape {want} (batch, length, vocab_size)")


def _flat(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if hasattr(tree, "items"):
        return [x for k, v in tree.items() for x in _flat(v, f"{prefix}{k}/")]
    return [(prefix.rstrip("/"), tree)]


def abstract_params(cfg: ModelConfig) -> Params:
    """Shapes and dtypes of :func:`init_params` (``jax.ShapeDtypeStruct`` leaves), no allocation."""
    # The key is made inside the trace: a concrete one would start a backend (threads) in processes that
    # only plan, such as the launcher before it forks its children.
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _plain(tree: Any) -> Any:
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def apply(params: Params, cfg: ModelConfig, tokens_BxL: jax.Array) -> jax.Array:
    """Logits BxLxV for token ids BxL (L <= cfg.seq_len)."""
    if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] > cfg.seq_len:
        raise ValueError(f"tokens must have shape (batch, L<= seq_len={cfg.seq_len}), got {tokens_BxL.shape}")
    return build(cfg).apply({"params": params}, tokens_BxL)


def loss_fn(params: Params, cfg: ModelConfig, tokens_BxLp1: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a batch of length seq_len + 1 windows."""
    logits = apply(params, cfg, tokens_BxLp1[:, :-1])
    targets = tokens_BxLp1[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def param_count(params: Any) -> int:
    """Number of scalars in a parameter pytree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward) at full context, as in Chinchilla's 6N rule.

    6 x matmul parameters (embedding lookups are free) plus causal attention
    scores and values: 6 * n_layers * seq_len * d_model (half of a full square).
    A user module: 6 x all its parameters (its attention, if any, is unknown).
    """
    if cfg.module:
        return 6 * param_count(abstract_params(cfg))
    per_block = 4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_ff
    matmul_params = cfg.n_layers * per_block + cfg.d_model * cfg.vocab_size
    return 6 * matmul_params + 6 * cfg.n_layers * cfg.seq_len * cfg.d_model


# Repeated blocks, as the built-in model and common flax code name them (block_3, layers_3, Block_3, h_3).
_BLOCK = re.compile(r"^(?:block|blocks|layer|layers|Block|h)_(\d+)/")


def layer_index(name: str) -> int | None:
    """Block index of a flat tensor name (``block_3/attn/qkv/kernel`` -> 3), else None (the layer
    fragmenters put such tensors with the first fragment; the default balanced one ignores layers)."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def is_embedding(name: str) -> bool:
    """True for input embeddings (``embed/...``, ``pos_embed/...``, and any flax ``nn.Embed`` table,
    whose parameter is named ``embedding``).

    The merge averages these plainly instead of with RDA. The output projection
    ``lm_head`` is untied and treated as an ordinary (non-embedding) matrix.
    """
    return name.startswith(("embed/", "pos_embed/")) or name.endswith("/embedding")


__all__ = [
    "ConfigError", "ModelConfig", "PRESETS", "Params", "Transformer", "abstract_params", "apply", "build", "flops_per_token",
    "init_params", "is_embedding", "layer_index", "loss_fn", "param_count", "preset",
]
