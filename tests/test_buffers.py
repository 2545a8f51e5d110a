"""buffers.BufferPool: a buffer comes back only once nothing refers to it; the pool keeps a bounded few."""
import numpy as np
import pytest

from wan_diloco.buffers import BufferPool


def test_a_buffer_is_handed_out_again_only_once_no_view_of_it_is_left():
    pool = BufferPool(keep=3)
    a = pool.empty(10)
    first = id(a.base)
    view = a.reshape(2, 5)[1:]  # a view of a view still holds the buffer
    del a
    b = pool.empty(8)
    assert id(b.base) != first
    b[:] = 1.0
    del view
    c = pool.empty(6)  # the smallest idle buffer large enough
    assert id(c.base) == first and c.size == 6 and c.dtype == np.float32


def test_held_buffers_stay_listed_and_come_back_once_let_go_and_idle_ones_stay_bounded():
    pool = BufferPool(keep=2)
    held = [pool.empty(4) for _ in range(4)]
    for i, h in enumerate(held):
        h[:] = i
    assert len(pool._bufs) == 4  # in use: none evicted, whatever keep
    assert [float(h[0]) for h in held] == [0.0, 1.0, 2.0, 3.0]  # nothing handed out twice
    first = id(held[0].base)
    del held[0]  # let go after three newer ones: it comes back (a syncer's Θ after a round or two)
    assert id(pool.empty(4).base) == first
    held.clear()
    del h  # the loop variable held the last one
    big = pool.empty(100)  # four idle, none large enough: a new one, and the idle beyond keep leave
    assert len(pool._bufs) == 3 and pool._bufs[-1] is big.base


def test_split_cuts_one_buffer_into_tensors():
    parts = BufferPool().split([3, 0, 5])
    assert [p.size for p in parts] == [3, 0, 5] and parts[0].base is parts[2].base


def test_keep_is_validated():
    with pytest.raises(ValueError, match="keep must be an integer >= 1, got 0"):
        BufferPool(keep=0)
