"""Corpora, per-learner shards and batches.

The default corpus is the running interpreter's own standard library: its
``.py`` files (test directories and site-packages excluded) read as bytes, so
the vocabulary is 256 and nothing needs downloading. Other corpora: a text
file, a directory of files (read recursively as bytes, hidden entries
skipped) or a ``*.bin`` file of raw little-endian token ids (uint16/uint32,
the nanoGPT layout).

Everything is deterministic: files are read in sorted relative-path order and
batches depend only on their seed. Nothing is cached on disk.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from wan_diloco.config import require

# Directory names skipped in the stdlib corpus: tests hold generated and
# deliberately odd data, and site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how the eval split is held out."""

    corpus: str = "stdlib"  # "stdlib", a text file, a directory, or a *.bin token file
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # element type of a *.bin corpus
    vocab_size: int = 256  # must match the model; byte corpora need >= 256
    # Cap on bytes read, so startup stays quick; files past the cap are dropped
    # whole (directories) or the file is truncated (single file, *.bin).
    max_bytes: int = 32 * 2**20
    eval_every_nth_file: int = 10  # directories: every nth file (sorted) is held out
    eval_fraction: float = 0.05  # single file / *.bin: the tail fraction is held out
    # 0: contiguous shards (learners see different files); > 0: blocks of this many tokens dealt round-robin.
    shard_block_tokens: int = 0

    def validate(self) -> None:
        require(self.corpus != "", "corpus", "must be 'stdlib' or a path")
        require(0 < self.vocab_size <= 2**32, "vocab_size", f"must be in 1..2**32, got {self.vocab_size}")
        require(self.max_bytes > 0, "max_bytes", f"must be positive, got {self.max_bytes}")
        require(self.eval_every_nth_file >= 2, "eval_every_nth_file",
                f"must be >= 2, got {self.eval_every_nth_file}")
        require(0.0 < self.eval_fraction < 1.0, "eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        require(self.shard_block_tokens >= 0, "shard_block_tokens", f"must be >= 0, got {self.shard_block_tokens}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and eval token streams (1-D integer arrays) and where they came from."""

    name: str
    train: np.ndarray
    eval: np.ndarray
    train_files: tuple[str, ...] = ()  # relative paths, for directory corpora
    eval_files: tuple[str, ...] = ()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, suffix: str | None, skip_dirs: frozenset[str]) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden entries (.git, editor state) are not corpus text.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                found.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(found)


def _load_dir(root: Path, cfg: DataConfig, name: str, suffix: str | None,
              skip_dirs: frozenset[str]) -> Corpus:
    files = _list_files(root, suffix, skip_dirs)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    total = 0
    for i, rel in enumerate(files):
        data = (root / rel).read_bytes()
        if total + len(data) > cfg.max_bytes:
            break
        total += len(data)
        held_out = i % cfg.eval_every_nth_file == cfg.eval_every_nth_file - 1
        parts[held_out].append(data)
        names[held_out].append(rel)
    require(total > 0, "corpus", f"{name}: no non-empty files found under {root}"
            + (f" (or the first exceeds max_bytes={cfg.max_bytes})" if files else ""))
    require(len(names[True]) > 0 and sum(map(len, parts[True])) > 0, "eval_every_nth_file",
            f"{name}: only {len(names[False])} files read, so every "
            f"{cfg.eval_every_nth_file}th file gives no eval data; lower eval_every_nth_file")
    train, evl = (np.frombuffer(b"".join(parts[k]), dtype=np.uint8) for k in (False, True))
    return Corpus(name, train, evl, tuple(names[False]), tuple(names[True]))


def _split_tail(tokens: np.ndarray, cfg: DataConfig, name: str) -> Corpus:
    n_eval = int(len(tokens) * cfg.eval_fraction)
    require(n_eval > 0 and len(tokens) - n_eval > 0, "corpus",
            f"{name}: {len(tokens)} tokens is too few to split with eval_fraction={cfg.eval_fraction}")
    return Corpus(name, tokens[:-n_eval], tokens[-n_eval:])


def _load_bin(path: Path, cfg: DataConfig) -> Corpus:
    dtype = np.dtype(cfg.token_dtype)
    size = path.stat().st_size
    require(size % dtype.itemsize == 0, "token_dtype",
            f"{path}: size {size} bytes is not a multiple of {cfg.token_dtype} ({dtype.itemsize} bytes)")
    n_tokens = min(size, cfg.max_bytes) // dtype.itemsize
    require(n_tokens > 0, "corpus", f"{path}: empty token file")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))
    top = int(tokens.max())
    require(top < cfg.vocab_size, "vocab_size",
            f"{path}: contains token id {top}, but vocab_size is {cfg.vocab_size}")
    return _split_tail(tokens, cfg, str(path))


def check_corpus(cfg: DataConfig) -> None:
    """What can be told of the corpus without reading it (it exists; a byte corpus fits the vocabulary):
    ConfigError before any process starts rather than in each learner."""
    cfg.validate()
    path = Path(cfg.corpus)
    if cfg.corpus != "stdlib":
        require(path.exists(), "corpus", f"{path}: no such file or directory")
    if cfg.corpus == "stdlib" or not (path.is_file() and path.suffix == ".bin"):
        _require_bytes_vocab(cfg)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured corpus; missing, empty or out-of-vocabulary input raises ConfigError."""
    check_corpus(cfg)
    if cfg.corpus == "stdlib":
        root = stdlib_root()
        name = f"stdlib-{sys.version_info.major}.{sys.version_info.minor}"
        return _load_dir(root, cfg, name, ".py", _STDLIB_SKIP_DIRS)
    path = Path(cfg.corpus)
    if path.is_file() and path.suffix == ".bin":
        return _load_bin(path, cfg)
    if path.is_dir():
        return _load_dir(path, cfg, str(path), None, frozenset({"__pycache__"}))
    with open(path, "rb") as f:
        data = f.read(cfg.max_bytes)
    require(len(data) > 0, "corpus", f"{path}: empty file")
    return _split_tail(np.frombuffer(data, dtype=np.uint8), cfg, str(path))


def _require_bytes_vocab(cfg: DataConfig) -> None:
    require(cfg.vocab_size >= 256, "vocab_size",
            f"byte corpora need vocab_size >= 256, got {cfg.vocab_size}")


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


__all__ = ["Batch", "Corpus", "DataConfig", "FailoverBatches", "Shard", "batches", "eval_batches", "load_corpus",
           "shard", "stdlib_root"]
