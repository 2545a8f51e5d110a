"""Per-learner shards of the training stream and batches drawn from them (``data.py`` reads the corpora).

A learner reads its own disjoint shard; while others are down it also reads theirs
(``FailoverBatches``), so every shard is read at the same rate. Batches depend only
on their seed, and a stream's position can be saved and restored.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from wan_diloco.config import require


@dataclasses.dataclass(frozen=True)
class Shard:
    """One learner's contiguous, disjoint slice of the training stream."""

    tokens: np.ndarray
    learner_id: int
    num_learners: int
    start: int  # offset of the slice in the training stream
    stop: int


def shard(train: np.ndarray, learner_id: int, num_learners: int, block_tokens: int = 0) -> Shard:
    """Learner ``learner_id``'s disjoint share of ``train``.

    ``block_tokens = 0``: one contiguous slice (a learner sees only some files,
    like regions holding different data). ``block_tokens > 0``: blocks of that
    many tokens dealt round-robin, so every learner sees the whole corpus's mix.
    """
    require(num_learners > 0, "num_learners", f"must be positive, got {num_learners}")
    require(0 <= learner_id < num_learners, "learner_id",
            f"must be in 0..{num_learners - 1}, got {learner_id}")
    require(block_tokens >= 0, "block_tokens", f"must be >= 0, got {block_tokens}")
    if block_tokens:
        n_blocks = -(-len(train) // block_tokens)
        mine = [train[b * block_tokens:(b + 1) * block_tokens] for b in range(learner_id, n_blocks, num_learners)]
        tokens = np.concatenate(mine) if mine else train[:0]
        return Shard(tokens, learner_id, num_learners, learner_id * block_tokens, len(train))
    start = learner_id * len(train) // num_learners
    stop = (learner_id + 1) * len(train) // num_learners
    return Shard(train[start:stop], learner_id, num_learners, start, stop)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Windows of seq_len + 1 tokens; ``n_tokens`` counts the predicted positions."""

    tokens: np.ndarray  # (batch_size, seq_len + 1) int32
    n_tokens: int


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens[idx], dtype=np.int32)


def _check_len(tokens: np.ndarray, batch_size: int, seq_len: int, what: str) -> None:
    require(batch_size > 0, "batch_size", f"must be positive, got {batch_size}")
    require(seq_len > 0, "seq_len", f"must be positive, got {seq_len}")
    require(len(tokens) >= seq_len + 1, what,
            f"{len(tokens)} tokens is shorter than one window of seq_len + 1 = {seq_len + 1}")


class FailoverBatches:
    """Learner ``learner_id``'s batches that also read the shards of learners that are down.

    Shards are disjoint and may hold different data (one region's files), so a
    learner that is down would otherwise take its data out of the global mix
    for as long as it is away; data parallel, which stalls instead, never
    loses it. Here every live learner draws each window from its own shard with
    probability live/M and from each down learner's shard with probability
    1/M, so every shard is still read at the same rate. With nobody down the
    stream equals :func:`batches` with the same seed.
    """

    def __init__(self, shards: list[np.ndarray], learner_id: int, batch_size: int, seq_len: int, seed: int):
        require(0 <= learner_id < len(shards), "learner_id",
                f"must be in 0..{len(shards) - 1}, got {learner_id}")
        for m, s in enumerate(shards):
            _check_len(s, batch_size, seq_len, f"shard {m}")
        self.shards, self.learner_id = shards, learner_id
        self.batch_size, self.seq_len = batch_size, seq_len
        self._rng = np.random.default_rng(seed)
        self.drawn = 0  # batches drawn so far (also across restores): how far into the stream it is

    def position(self) -> dict:
        """Where the stream is (JSON-able): with ``restore`` the next batches are the same again."""
        return {"learner": self.learner_id, "batches": self.drawn, "rng": self._rng.bit_generator.state}

    def restore(self, position: dict) -> None:
        """Continue from a ``position`` of this learner's stream; ValueError if it is not one."""
        if not isinstance(position, dict) or position.get("learner") != self.learner_id:
            raise ValueError(f"data position: not one of learner {self.learner_id}'s streams")
        drawn = position.get("batches", 0)  # absent in positions written before it was counted
        if isinstance(drawn, bool) or not isinstance(drawn, int) or drawn < 0:
            raise ValueError(f"data position: batches must be a non-negative integer, got {str(drawn)[:40]!r}")
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = position.get("rng")
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"data position: {e}") from None
        self._rng, self.drawn = rng, drawn

    def next(self, down: frozenset[int] = frozenset()) -> Batch:
        """The next batch, given which learners are down now (this learner is never down to itself)."""
        b, L, M = self.batch_size, self.seq_len, len(self.shards)
        others = sorted(d for d in down if d != self.learner_id)
        require(all(0 <= d < M for d in others), "down", f"learner ids must be in 0..{M - 1}, got {sorted(down)}")
        self.drawn += 1
        if not others:
            own = self.shards[self.learner_id]
            return Batch(_windows(own, self._rng.integers(0, len(own) - L, size=b), L), b * L)
        sources = [self.learner_id, *others]
        probs = np.array([(M - len(others)) / M] + [1 / M] * len(others))
        picks = self._rng.choice(len(sources), size=b, p=probs)
        rows = []
        for k in picks:
            tokens = self.shards[sources[k]]
            start = self._rng.integers(0, len(tokens) - L, size=1)
            rows.append(_windows(tokens, start, L))
        return Batch(np.concatenate(rows), b * L)


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> Iterator[Batch]:
    """Endless batches of uniformly random windows from ``tokens``; same seed, same stream."""
    source = FailoverBatches([tokens], 0, batch_size, seq_len, seed)
    while True:
        yield source.next()


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int) -> list[np.ndarray]:
    """A fixed list of eval batches: evenly spaced windows across ``tokens``."""
    require(n_batches > 0, "n_batches", f"must be positive, got {n_batches}")
    _check_len(tokens, batch_size, seq_len, "eval split")
    starts = np.linspace(0, len(tokens) - seq_len - 1, batch_size * n_batches).astype(np.int64)
    return [_windows(tokens, s, seq_len) for s in starts.reshape(n_batches, batch_size)]
