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
