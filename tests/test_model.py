import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_diloco import model as m
from wan_diloco.config import ConfigError, from_mapping
from wan_diloco.tree import flatten

from tests.conftest import micro_model

MICRO = micro_model(seq_len=16)


@pytest.fixture(scope="module")
def params():
    return m.init_params(MICRO, jax.random.key(0))


@pytest.mark.parametrize("name,lo,hi", [("tiny", 1e5, 1e6), ("small", 5e6, 2e7), ("base", 7e7, 1.5e8)])
def test_preset_param_counts(name, lo, hi):
    n = m.param_count(m.abstract_params(m.preset(name)))
    assert lo <= n <= hi


def test_param_count_matches_formula(params):
    d, f, v, n_layers = MICRO.d_model, MICRO.d_ff, MICRO.vocab_size, MICRO.n_layers
    per_block = 3 * d * d + d * d + 2 * d * f + 2 * d
    assert m.param_count(params) == n_layers * per_block + 2 * v * d + d


def test_unknown_preset_names_valid_ones():
    with pytest.raises(ConfigError, match="tiny, small, base"):
        m.preset("huge")


@pytest.mark.parametrize("bad,field", [({"n_heads": 3}, "n_heads"), ({"d_model": 0}, "d_model"),
                                       ({"d_model": 24, "n_heads": 8}, "n_heads")])
def test_config_validation(bad, field):
    with pytest.raises(ConfigError, match=field):
        from_mapping(m.ModelConfig, bad)


def test_params_are_plain_float32_dicts(params):
    assert type(params) is dict
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_output_shape(params):
    tokens = jnp.zeros((3, 7), jnp.int32)
    assert m.apply(params, MICRO, tokens).shape == (3, 7, 256)


def test_too_long_input_rejected(params):
    with pytest.raises(ValueError, match="seq_len"):
        m.apply(params, MICRO, jnp.zeros((1, MICRO.seq_len + 1), jnp.int32))


def test_causal(params):
    tokens = jax.random.randint(jax.random.key(1), (2, MICRO.seq_len), 0, 256)
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 256)
    a, b = m.apply(params, MICRO, tokens), m.apply(params, MICRO, changed)
    np.testing.assert_allclose(a[:, :9], b[:, :9], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 9:], b[:, 9:])


def test_names_embedding_and_layer(params):
    names = list(flatten(params))
    assert "embed/embedding" in names and "block_1/attn/qkv/kernel" in names
    assert "lm_head/kernel" in names and "final_norm/scale" in names
    assert [n for n in names if m.is_embedding(n)] == ["embed/embedding"]
    layers = {n: m.layer_index(n) for n in names}
    assert layers["block_1/mlp/fc_out/kernel"] == 1 and layers["block_0/attn_norm/scale"] == 0
    assert layers["lm_head/kernel"] is None and layers["embed/embedding"] is None
    assert {i for i in layers.values() if i is not None} == set(range(MICRO.n_layers))
    assert m.is_embedding("pos_embed/embedding") and m.layer_index("block_12/x") == 12


def test_initial_loss_near_uniform(params):
    tokens = jax.random.randint(jax.random.key(2), (4, MICRO.seq_len + 1), 0, 256)
    loss = float(m.loss_fn(params, MICRO, tokens))
    assert abs(loss - math.log(256)) < 0.1


def test_loss_is_next_token_cross_entropy(params):
    tokens = jax.random.randint(jax.random.key(3), (2, MICRO.seq_len + 1), 0, 256)
    logits = m.apply(params, MICRO, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    expected = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    np.testing.assert_allclose(m.loss_fn(params, MICRO, tokens), expected, rtol=1e-5)


def test_flops_per_token_counts_matmul_params(params):
    flat = flatten(params)
    matmul = sum(x.size for n, x in flat.items() if x.ndim == 2 and not m.is_embedding(n))
    attention = 6 * MICRO.n_layers * MICRO.seq_len * MICRO.d_model
    assert m.flops_per_token(MICRO) == 6 * matmul + attention


# ---- the user's own flax module -------------------------------------------------------------------

USER = Path(__file__).parent / "fixtures" / "user_model.py"


def user_cfg(factory: str = "make", where: str | None = None) -> m.ModelConfig:
    return m.ModelConfig(vocab_size=256, seq_len=16, module=f"{where or USER}:{factory}")


def test_a_user_module_from_a_file_trains_like_a_preset():
    cfg = user_cfg()
    params = m.init_params(cfg, jax.random.key(0))
    names = set(flatten(params))
    assert "mix/kernel" in names and "layers_1/kernel" in names and "Embed_0/embedding" in names
    assert "block_0/attn/qkv/kernel" not in names  # not the built-in transformer
    assert m.is_embedding("Embed_0/embedding") and m.layer_index("layers_1/kernel") == 1
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    assert m.apply(params, cfg, tokens[:, :-1]).shape == (2, 16, 256)
    assert abs(float(m.loss_fn(params, cfg, tokens)) - math.log(256)) < 0.5  # near uniform at init
    abstract = m.abstract_params(cfg)
    assert {n: a.shape for n, a in flatten(abstract).items()} == {n: a.shape for n, a in flatten(params).items()}
    assert m.flops_per_token(cfg) == 6 * m.param_count(params)


def test_a_user_module_by_dotted_name_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_lm.py").write_text(USER.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    params = m.init_params(m.ModelConfig(vocab_size=256, seq_len=16, module="my_lm:make"), jax.random.key(0))
    assert "mix/kernel" in flatten(params)


@pytest.mark.parametrize("cfg, message", [
    (m.ModelConfig(module="no_colon_here"), "must be 'package.module:factory'"),
    (m.ModelConfig(module="/nowhere/model.py:make"), "/nowhere/model.py: no such file"),
    (m.ModelConfig(module="wan_diloco_no_such_pkg.mod:make"), "cannot load 'wan_diloco_no_such_pkg.mod' (ModuleNotFoundError"),
    (user_cfg("missing"), "has no callable 'missing'"),
    (user_cfg("not_a_module"), "returned str, not a flax.linen.Module"),
    (user_cfg("wrong_logits"), "expected float logits of shape (1, 16, 256)"),
    (user_cfg("with_stats"), "variable collections ['batch_stats'] besides 'params'"),
    (user_cfg("half_precision"), "is bfloat16; parameters must be float32"),
])
def test_a_user_module_that_does_not_fit_is_a_config_error_naming_what(cfg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        m.abstract_params(cfg)


def test_a_user_module_file_that_raises_is_reported_in_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import flax\nraise RuntimeError('the user forgot something')\n")
    with pytest.raises(ConfigError, match=r"cannot load .*broken.py' \(RuntimeError: the user forgot something\)"):
        m.init_params(m.ModelConfig(module=f"{bad}:make"), jax.random.key(0))
