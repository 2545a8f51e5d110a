"""Float32 buffers handed out again once nothing refers to them: the syncer's hot path without fresh pages.

A syncer's round sums its uploads into a fragment-sized array that at the close takes the new
momentum, the old momentum's array taking the new Θ and the old Θ's going free. Fresh arrays that
size come from ``mmap`` and each first
touch of a page is a fault the kernel zeroes: a quarter of a CPU second per GB, as much as the NF4
lookup itself. ``BufferPool.empty`` hands out a slice of a buffer it made before once no array refers to
it any more (numpy views keep their base alive, so the base's reference count says when the last one
went away): nothing handed out is ever written under its holder. It keeps a few buffers; past that
the oldest leaves the pool (freed once its holders let go). Memory it keeps idle is the price: at most
``keep`` buffers.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Mapping

import numpy as np

# getrefcount while a buffer sits idle in the list: the list's reference, the loop variable's, the call's own.
_IDLE_REFS = 3


class BufferPool:
    """``empty(n)``: a float32 array of n values, reusing an idle pooled buffer when one is large enough."""

    def __init__(self, keep: int = 4):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.keep = keep
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, n: int) -> np.ndarray:
        with self._lock:
            fit, fit_size = -1, None
            for i in range(len(self._bufs)):  # not enumerate: its tuple would hold a reference
                b = self._bufs[i]
                if b.size >= n and sys.getrefcount(b) == _IDLE_REFS and (fit_size is None or b.size < fit_size):
                    fit, fit_size = i, b.size
            b = None
            if fit >= 0:
                return self._bufs[fit][:n]
            buf = np.empty(n, np.float32)
            self._bufs.append(buf)
            # Buffers still held stay listed (they come back when let go: a syncer's momentum and Θ are
            # pooled buffers that change places every round); idle ones past ``keep`` leave, oldest first.
            idle = []
            for i in range(len(self._bufs) - 1):
                b = self._bufs[i]  # held in a variable as in the search above: the same count when idle
                if sys.getrefcount(b) == _IDLE_REFS:
                    idle.append(i)
            b = None
            for i in reversed(idle[:max(0, len(idle) - self.keep)]):
                del self._bufs[i]
            return buf[:n]

    def clear(self) -> None:
        """Forget every buffer (those still held live on with their holders): memory measured from here
        counts the pool's buffers too."""
        with self._lock:
            self._bufs.clear()

    def split(self, sizes: list[int]) -> list[np.ndarray]:
        """One pooled buffer cut into flat arrays of ``sizes`` (a fragment's tensors)."""
        buf = self.empty(sum(sizes))
        out, pos = [], 0
        for n in sizes:
            out.append(buf[pos:pos + n])
            pos += n
        return out


POOL = BufferPool()


def pooled_copy(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """float32 copies of ``arrays`` in one buffer of ``POOL`` (a syncer's Θ or momentum of one fragment): the
    arrays a close lets go come back to the pool for the next round's sums, from the first round on."""
    flat = [np.ravel(np.asarray(a, np.float32)) for a in arrays.values()]
    out = POOL.split([x.size for x in flat])
    for o, x in zip(out, flat):
        np.copyto(o, x)
    return {n: o.reshape(np.shape(a)) for (n, a), o in zip(arrays.items(), out)}

_local = threading.local()


def thread_scratch(n: int, slot: int = 0) -> np.ndarray:
    """This thread's float32 scratch of ``n`` values, grown on demand and reused: a work item's values
    (at most ``merge.CHUNK``, 1 MiB: it stays in cache) made, decoded or padded on a pool's thread.
    ``slot``: 0 or 1, two scratches a pass may use at once (an item's values and their decoded twin)."""
    bufs = getattr(_local, "values", None)
    if bufs is None:
        bufs = _local.values = [None, None]
    buf = bufs[slot]
    if buf is None or buf.size < n:
        buf = bufs[slot] = np.empty(max(n, 1 << 18), np.float32)
    return buf[:n]
