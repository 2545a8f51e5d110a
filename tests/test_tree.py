import numpy as np
import pytest

from wan_diloco import tree


def test_flatten_roundtrip_and_names():
    params = {"block_0": {"attn": {"kernel": np.ones((2, 3))}}, "embed": {"embedding": np.zeros(4)}}
    flat = tree.flatten(params)
    assert list(flat) == ["block_0/attn/kernel", "embed/embedding"]
    back = tree.unflatten(flat, params)
    np.testing.assert_array_equal(back["block_0"]["attn"]["kernel"], params["block_0"]["attn"]["kernel"])


def test_unflatten_rejects_wrong_names():
    params = {"a": np.ones(2)}
    with pytest.raises(KeyError, match="missing"):
        tree.unflatten({"b": np.ones(2)}, params)


def test_named_tensors_of_an_optimizer_state_check_names_shapes_and_dtypes():
    import optax

    params = {"w": np.ones((2, 2), np.float32)}
    opt = optax.adam(1e-3).init(params)
    tensors = tree.to_named(opt, "opt")
    back = tree.from_named(tensors, "opt", opt, "learner part")
    assert np.array_equal(np.asarray(back[0].mu["w"]), np.asarray(opt[0].mu["w"]))
    bad = dict(tensors)
    bad["opt/0/count"] = bad["opt/0/count"].astype(np.int64)
    with pytest.raises(ValueError, match="opt/0/count"):
        tree.from_named(bad, "opt", opt, "learner part")
    with pytest.raises(ValueError, match="unexpected"):
        tree.from_named({**tensors, "opt/x": np.zeros(1)}, "opt", opt, "learner part")
