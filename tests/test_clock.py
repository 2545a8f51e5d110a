import pytest
from hypothesis import given, strategies as st

from wan_diloco.clock import VectorClock

clocks = st.dictionaries(st.sampled_from(["a", "b", "c", "syncer"]), st.integers(0, 5)).map(VectorClock)


def test_message_chain_orders_events():
    a0 = VectorClock().tick("a")
    b1 = VectorClock().receive("b", a0)  # b received a's message
    assert a0.happened_before(b1) and not b1.happened_before(a0)
    assert b1.compare(a0) == "after"


def test_independent_events_are_concurrent():
    a = VectorClock().tick("a")
    b = VectorClock().tick("b")
    assert a.concurrent(b) and b.concurrent(a)
    m = a.merge(b)
    assert a.happened_before(m) and b.happened_before(m)


def test_zeros_do_not_matter():
    assert VectorClock({"a": 0, "b": 2}) == VectorClock({"b": 2})
    assert VectorClock({"a": 0}).compare(VectorClock()) == "equal"


@given(clocks, clocks, clocks)
def test_merge_is_a_join(x, y, z):
    m = x.merge(y)
    assert x <= m and y <= m
    assert m == y.merge(x)
    assert x.merge(y).merge(z) == x.merge(y.merge(z))
    assert x.compare(y) in {"before", "after", "equal", "concurrent"}


@pytest.mark.parametrize("bad", [{"a": -1}, {"a": 1.5}, {"": 1}, {"a": True}])
def test_bad_entries_rejected(bad):
    with pytest.raises(ValueError, match="vector clock"):
        VectorClock(bad)


def test_roundtrip_dict():
    c = VectorClock({"a": 3, "syncer": 1})
    assert VectorClock.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError):
        VectorClock.from_dict([1, 2])
