"""Vectorized helpers on time intervals and piecewise-constant functions (numpy arrays of seconds)."""
from __future__ import annotations

import numpy as np


def absorbing_pauses(times: np.ndarray, durations_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pauses triggered by events at sorted ``times``; an event that arrives during a
    pause is absorbed by it (the pause reads membership when it ends) and does not
    start or extend one. Returns (starts, ends)."""
    starts, ends = [], []
    end = -np.inf
    # A data-dependent scan: each pause decides which later events it absorbs.
    for t, d in zip(times.tolist(), durations_s.tolist()):
        if t >= end:
            end = t + d
            starts.append(t)
            ends.append(end)
    return np.asarray(starts, float), np.asarray(ends, float)


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint (starts, ends)."""
    if len(starts) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new = np.r_[True, s[1:] > e[:-1]]
    last = np.r_[np.flatnonzero(new)[1:] - 1, len(s) - 1]
    return s[new], e[last]


def clip(starts: np.ndarray, ends: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Intervals cut to [0, horizon_s], empty ones dropped."""
    s, e = np.clip(starts, 0, horizon_s), np.clip(ends, 0, horizon_s)
    keep = e > s
    return s[keep], e[keep]


class StepFunction:
    """Integer-valued function of time from +1/-1 steps; integrates exactly."""

    def __init__(self, up_times: np.ndarray, down_times: np.ndarray):
        t = np.concatenate([up_times, down_times])
        d = np.concatenate([np.ones(len(up_times)), -np.ones(len(down_times))])
        order = np.argsort(t, kind="stable")
        self.times = np.r_[0.0, t[order]]
        self.values = np.r_[0.0, np.cumsum(d[order])]  # value from times[i] until times[i+1]
        self._integral = np.r_[0.0, np.cumsum(self.values[:-1] * np.diff(self.times))]

    def integral_to(self, x: np.ndarray) -> np.ndarray:
        """∫_0^x f(t) dt for each x (exact: the integral is piecewise linear)."""
        x = np.asarray(x, float)
        i = np.clip(np.searchsorted(self.times, x, side="right") - 1, 0, None)
        return self._integral[i] + self.values[i] * (x - self.times[i])

    def intervals_at_least(self, level: float, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Where f >= level, within [0, horizon_s], as (starts, ends)."""
        at = self.values >= level
        nxt = np.r_[self.times[1:], np.inf]
        s, e = clip(self.times[at], nxt[at], horizon_s)
        return union(s, e)


def measure(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of disjoint intervals."""
    return float(np.sum(ends - starts))
