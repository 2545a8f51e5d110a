"""Corpora, per-learner shards and batches.

A corpus is a stream of token ids, split once into train and eval. Its kinds
(``DataConfig.corpus``; docs/data.md is the user's guide):

- ``"stdlib"`` (the default): the running interpreter's standard library, its
  ``.py`` files (test directories and site-packages excluded), so nothing needs
  downloading;
- a text file, or a directory of text files (read recursively, hidden entries skipped);
- dataset files: a ``*.jsonl`` file (one JSON object per line), a ``*.parquet``
  file, or a directory holding such files (a local Hugging Face ``datasets``
  export); each record's ``text_field`` is one document;
- token ids: a ``*.bin`` of raw little-endian ids (``token_dtype``, the nanoGPT
  layout) or a ``*.npy`` 1-D integer array, both memory-mapped.

Text is read as bytes (vocabulary 256) unless ``tokenizer`` names a Hugging
Face ``tokenizers`` JSON file. Hold-out: directories and dataset files send
every ``eval_every_nth_file``-th document (a file of a text directory, a record
of a dataset) to eval; a single text or token file, its tail ``eval_fraction``.
``max_bytes`` > 0 caps what is read, and :attr:`Corpus.truncated` says so.

Everything is deterministic: files are read in sorted relative-path order and
batches depend only on their seed. Nothing is cached on disk or downloaded.
How each kind of file is read is in :mod:`wan_diloco.data_sources`; shards and batches
(re-exported here) in :mod:`wan_diloco.data_batches`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np

from wan_diloco import data_sources as sources
from wan_diloco.config import require
from wan_diloco.data_batches import Batch, FailoverBatches, Shard, batches, eval_batches, shard

# Directory names skipped in the stdlib corpus: tests hold generated and
# deliberately odd data, and site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
BIN_DTYPES = ("uint8", "uint16", "uint32", "int32")
# Tokenize documents in batches of about this much text: encode_batch works in
# parallel on a batch, and a batch's Encodings are dropped before the next.
_ENCODE_BATCH_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how the eval split is held out."""

    # "stdlib", a text file or directory, a *.jsonl / *.parquet file or a directory of them, *.bin or *.npy
    corpus: str = "stdlib"
    token_dtype: Literal["uint8", "uint16", "uint32", "int32"] = "uint16"  # of a *.bin corpus (a .npy has its own)
    vocab_size: int = 256  # must match the model; byte corpora need >= 256, tokenized ones the tokenizer's size
    tokenizer: str = ""  # a `tokenizers` JSON file that tokenizes text corpora; "": text is read as bytes
    text_field: str = "text"  # the text of a *.jsonl record or *.parquet row
    # Cap on bytes read (0: the whole corpus); Corpus.truncated tells when it cut. Past the cap,
    # documents are dropped whole (directories, dataset files) or the file is cut (text file, *.bin, *.npy).
    max_bytes: int = 0
    # Directories and dataset files: every nth document (a file, a record), in reading order, is held out.
    eval_every_nth_file: int = 10
    eval_fraction: float = 0.05  # single text file / *.bin / *.npy: the tail fraction is held out
    # "validation": the eval split is set aside unread and the same rule holds a validation split out of
    # what is left, which the run then evaluates on: settings are tuned there, never on eval.
    holdout: Literal["eval", "validation"] = "eval"
    # 0: contiguous shards (learners see different files); > 0: blocks of this many tokens dealt round-robin.
    shard_block_tokens: int = 0
    # (region, corpus) pairs, the TOML table [data.regions]: the learners of that region read that corpus
    # (their own data, or the same data at another path) instead of `corpus`, split among themselves.
    regions: tuple[tuple[str, str], ...] = ()

    def corpus_of(self, region: str) -> str:
        """The corpus the learners of ``region`` read."""
        return dict(self.regions).get(region, self.corpus)

    def validate(self) -> None:
        require(self.corpus != "", "corpus", "must be 'stdlib' or a path")
        require(self.token_dtype in BIN_DTYPES, "token_dtype",
                f"must be one of {', '.join(BIN_DTYPES)}, got {self.token_dtype!r}")
        require(0 < self.vocab_size <= 2**32, "vocab_size", f"must be in 1..2**32, got {self.vocab_size}")
        require(self.text_field != "", "text_field", "must name the field or column that holds the text")
        require(self.max_bytes >= 0, "max_bytes", f"must be >= 0 (0: the whole corpus), got {self.max_bytes}")
        require(self.eval_every_nth_file >= 2, "eval_every_nth_file",
                f"must be >= 2, got {self.eval_every_nth_file}")
        require(0.0 < self.eval_fraction < 1.0, "eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        require(self.holdout in ("eval", "validation"), "holdout",
                f"must be 'eval' or 'validation', got {self.holdout!r}")
        for pair in self.regions:
            require(len(pair) == 2 and all(isinstance(x, str) and x for x in pair), "regions",
                    f"each entry is a region name and its corpus path, got {list(pair)}")
        require(self.shard_block_tokens >= 0, "shard_block_tokens", f"must be >= 0, got {self.shard_block_tokens}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and eval token streams (1-D integer arrays) and where they came from."""

    name: str
    train: np.ndarray
    eval: np.ndarray
    train_files: tuple[str, ...] = ()  # relative paths, for directories of text files
    eval_files: tuple[str, ...] = ()
    truncated: str = ""  # how max_bytes cut the corpus short, for the user; "" when all of it was read


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class _Source:
    """What the corpus setting points at, resolved once."""

    kind: Literal["stdlib", "text", "text_dir", "records", "bin", "npy"]
    root: Path  # the directory, or the file itself
    files: tuple[str, ...] = ()  # directories and dataset files: paths relative to root, in reading order


def _list_files(root: Path, suffix: str | None, skip_dirs: frozenset[str]) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden entries (.git, editor state) are not corpus text.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                found.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(found)


def _source(cfg: DataConfig) -> _Source:
    if cfg.corpus == "stdlib":
        return _Source("stdlib", stdlib_root(), tuple(_list_files(stdlib_root(), ".py", _STDLIB_SKIP_DIRS)))
    path = Path(cfg.corpus)
    require(path.exists(), "corpus", f"{path}: no such file or directory")
    if path.is_dir():
        files = _list_files(path, None, frozenset({"__pycache__"}))
        # A dataset export holds a README and JSON metadata beside its records: only the records are read.
        records = tuple(f for f in files if f.lower().endswith(sources.RECORD_SUFFIXES))
        if records:
            return _Source("records", path, records)
        for f in files:
            why = sources.refusal(f, in_dir=True)
            require(why is None, "corpus", f"{path}: holds {f}, {why}; a directory without *.jsonl or *.parquet "
                    "files is read as text, so remove it or point data.corpus elsewhere")
        return _Source("text_dir", path, tuple(files))
    why = sources.refusal(path.name)
    require(why is None, "corpus", f"{path}: not a supported corpus file: {why}")
    suffix = path.suffix.lower()
    if suffix in sources.RECORD_SUFFIXES:
        return _Source("records", path.parent, (path.name,))
    return _Source({".bin": "bin", ".npy": "npy"}.get(suffix, "text"), path)


def _checked_source(cfg: DataConfig) -> _Source:
    cfg.validate()
    src = _source(cfg)
    if src.kind in ("bin", "npy"):
        require(cfg.tokenizer == "", "tokenizer", f"{src.root} already holds token ids; a tokenizer applies only "
                "to text corpora, so leave data.tokenizer empty")
    elif cfg.tokenizer:
        n = sources.tokenizer_vocab_size(sources.load_tokenizer(cfg.tokenizer))
        require(cfg.vocab_size >= n, "vocab_size", f"{cfg.vocab_size} is smaller than the {n} tokens of the "
                f"tokenizer {cfg.tokenizer}; set model.vocab_size >= {n}")
    else:
        require(cfg.vocab_size >= 256, "vocab_size", f"byte corpora need vocab_size >= 256, got {cfg.vocab_size}")
    if src.kind == "npy":
        sources.open_npy(src.root)
    for rel in src.files if src.kind == "records" else ():
        sources.probe_records(src.root / rel, cfg.text_field)
    return src


def check_corpus(cfg: DataConfig) -> None:
    """What can be told of the corpus without reading it all, as a ConfigError before any process starts
    rather than in each learner: it exists and is of a supported kind, the packages it needs are
    installed, the tokenizer loads and fits the vocabulary (or a byte corpus does), a ``.npy`` header
    holds a 1-D integer array, and each dataset file has the text field."""
    _checked_source(cfg)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured corpus; missing, empty, malformed or out-of-vocabulary input raises ConfigError."""
    src = _checked_source(cfg)
    if src.kind in ("bin", "npy"):
        return _load_tokens(src.root, cfg)
    encoder = _Encoder(cfg.tokenizer)
    if src.kind == "text":
        return _load_text_file(src.root, cfg, encoder)
    if src.kind == "records":
        docs = (doc for rel in src.files for doc in sources.read_records(src.root / rel, cfg.text_field))
        name = str(Path(cfg.corpus))
        split = _split_documents(docs, cfg, name, encoder, encoder.separator, "document")
        return Corpus(name, split.train, split.eval, truncated=split.truncated)
    name = str(Path(cfg.corpus)) if src.kind == "text_dir" else \
        f"stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    files = ((str(src.root / rel), (src.root / rel).read_bytes()) for rel in src.files)
    # Text files were always concatenated as they are (they end in a newline); tokenized, the model
    # is told where one ends.
    separator = encoder.separator if encoder.tokenizer is not None else encoder.separator[:0]
    split = _split_documents(files, cfg, name, encoder, separator, "file")
    read = src.files[:len(split.held_out)]
    return Corpus(name, split.train, split.eval, tuple(f for f, h in zip(read, split.held_out) if h == 0),
                  tuple(f for f, h in zip(read, split.held_out) if h == 1), split.truncated)


class _Encoder:
    """Documents to token ids: their bytes, or a tokenizer's ids."""

    def __init__(self, tokenizer_path: str):
        self.tokenizer: Any = sources.load_tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer is None:
            self.dtype, self.separator = np.dtype(np.uint8), np.frombuffer(b"\n\n", dtype=np.uint8)
        else:
            self.dtype = sources.token_dtype(self.tokenizer)
            self.separator = np.asarray(sources.separator_ids(self.tokenizer), dtype=self.dtype)

    def __call__(self, docs: list[tuple[str, bytes]]) -> list[np.ndarray]:
        if self.tokenizer is None:
            return [np.frombuffer(data, dtype=np.uint8) for _, data in docs]
        texts = [sources.decode_utf8(data, where) for where, data in docs]
        return sources.encode_texts(self.tokenizer, texts, self.dtype)


@dataclasses.dataclass(frozen=True)
class _Split:
    train: np.ndarray
    eval: np.ndarray
    held_out: bytes  # per document read, in order: 1 if it went to eval (or validation), 2 if set aside
    truncated: str


def _split_documents(docs: Iterable[tuple[str, bytes]], cfg: DataConfig, name: str, encode: _Encoder,
                     separator: np.ndarray, unit: str) -> _Split:
    """Every ``eval_every_nth_file``-th document to eval, the rest to train, each side's documents joined
    by ``separator``; reading stops before the first document that would pass ``max_bytes``. With
    ``holdout = "validation"`` the eval documents are set aside and every nth of the others is held out."""
    n, cap = cfg.eval_every_nth_file, cfg.max_bytes
    # One array per side and batch, not per document: millions of short records stay cheap.
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    held_out = bytearray()
    pending: list[tuple[str, bytes]] = []
    total_bytes, pending_bytes, truncated = 0, 0, ""

    def flush() -> None:
        batch: dict[bool, list[np.ndarray]] = {False: [], True: []}
        for held, tokens in zip(held_out[len(held_out) - len(pending):], encode(pending)):
            if len(tokens) and held != SET_ASIDE:
                batch[bool(held)].append(tokens)
        for side, arrays in batch.items():
            if arrays:
                parts[side].append(_join(arrays, separator, encode.dtype))
        pending.clear()

    kept = 0  # documents not set aside, for the validation rule
    for i, (where, data) in enumerate(docs):
        if cap and total_bytes + len(data) > cap:
            truncated = f"max_bytes={cap} stopped reading at {where} after {i} {unit}s ({total_bytes} bytes)"
            break
        total_bytes += len(data)
        if cfg.holdout == "eval":
            held_out.append(i % n == n - 1)
        elif i % n == n - 1:
            held_out.append(SET_ASIDE)
        else:
            held_out.append(kept % n == n - 1)
            kept += 1
        pending.append((where, data))
        pending_bytes += len(data)
        if pending_bytes >= _ENCODE_BATCH_BYTES:
            flush()
            pending_bytes = 0
    flush()
    require(total_bytes > 0, "corpus", f"{name}: no non-empty {unit}s"
            + (f" before {truncated}" if truncated else ""))
    train, evl = (_join(parts[k], separator, encode.dtype) for k in (False, True))
    short = f" ({truncated}; raise max_bytes)" if truncated else ""
    require(len(evl) > 0, "eval_every_nth_file", f"{name}: {len(held_out)} {unit}s read, so holding out every "
            f"{n}th {unit} gives no eval data{short}; lower eval_every_nth_file")
    require(len(train) > 0, "corpus", f"{name}: the {unit}s read left no training data{short}")
    return _Split(train, evl, bytes(held_out), truncated)


SET_ASIDE = 2  # a ``held_out`` mark: the eval document of a run that evaluates on validation


def _join(parts: list[np.ndarray], separator: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if len(separator) and parts:
        parts = [x for p in parts for x in (separator, p)][1:]
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _split_tail(tokens: np.ndarray, cfg: DataConfig, name: str, truncated: str = "") -> Corpus:
    """The tail ``eval_fraction`` to eval; with ``holdout = "validation"`` that tail is set aside and the
    tail of the same size before it is held out instead."""
    n_eval = int(len(tokens) * cfg.eval_fraction)
    held = 2 if cfg.holdout == "validation" else 1
    require(n_eval > 0 and len(tokens) - held * n_eval > 0, "corpus",
            f"{name}: {len(tokens)} tokens is too few to split with eval_fraction={cfg.eval_fraction}"
            + (" and holdout='validation'" if held == 2 else ""))
    end = len(tokens) - (held - 1) * n_eval
    return Corpus(name, tokens[:end - n_eval], tokens[end - n_eval:end], truncated=truncated)


def _load_text_file(path: Path, cfg: DataConfig, encode: _Encoder) -> Corpus:
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(cfg.max_bytes) if cfg.max_bytes else f.read()
    require(len(data) > 0, "corpus", f"{path}: empty file")
    truncated = "" if len(data) >= size else f"max_bytes={cfg.max_bytes} read the first {len(data)} of {size} " \
                                             f"bytes of {path}"
    if truncated and encode.tokenizer is not None:
        data = sources.whole_utf8(data)  # the cap may fall inside a character
    return _split_tail(encode([(str(path), data)])[0], cfg, str(path), truncated)


def _load_tokens(path: Path, cfg: DataConfig) -> Corpus:
    """A ``.bin`` or ``.npy`` token file, memory-mapped: nothing is read until used, save one pass over
    the ids to check them against the vocabulary."""
    if path.suffix.lower() == ".npy":
        tokens = sources.open_npy(path)
    else:
        dtype, size = np.dtype(cfg.token_dtype), path.stat().st_size
        require(size % dtype.itemsize == 0, "token_dtype",
                f"{path}: size {size} bytes is not a multiple of {cfg.token_dtype} ({dtype.itemsize} bytes)")
        require(size > 0, "corpus", f"{path}: empty token file")
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(size // dtype.itemsize,))
    require(len(tokens) > 0, "corpus", f"{path}: empty token file")
    itemsize, truncated = tokens.dtype.itemsize, ""
    if cfg.max_bytes and len(tokens) * itemsize > cfg.max_bytes:
        n_tokens = cfg.max_bytes // itemsize
        require(n_tokens > 0, "max_bytes", f"{path}: max_bytes={cfg.max_bytes} is less than one {itemsize}-byte token")
        truncated = f"max_bytes={cfg.max_bytes} read the first {n_tokens} of {len(tokens)} tokens of {path}"
        tokens = tokens[:n_tokens]
    sources.check_token_ids(tokens, cfg.vocab_size, str(path))
    return _split_tail(tokens, cfg, str(path), truncated)


__all__ = ["BIN_DTYPES", "Batch", "Corpus", "DataConfig", "FailoverBatches", "Shard", "batches", "check_corpus",
           "eval_batches", "load_corpus", "shard", "stdlib_root"]
