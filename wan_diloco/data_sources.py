"""How each kind of corpus file is read: token arrays (``.npy``), dataset records
(``.jsonl``, ``.parquet``) and text through a Hugging Face ``tokenizers`` tokenizer.

:mod:`wan_diloco.data` decides which corpus is read and how it is split; the
readers live here so that module stays short. The optional packages
(``tokenizers``, ``pyarrow``) are imported only when a corpus needs them, so
the package works without them. Every problem is a ConfigError that names the
file (with the line or row of a record) and what is wrong. Nothing here
downloads anything or unpickles anything.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from wan_diloco.config import ConfigError, require

TEXT_INSTALL = "pip install 'wan-diloco[text]'"
DATA_INSTALL = "pip install 'wan-diloco[data]'"
RECORD_SUFFIXES = (".jsonl", ".parquet")

# Files that read as bytes without complaint but are not text: training on them
# would be noise, so they are refused with what to do instead.
_REFUSED = {
    ".npz": "an archive of arrays: save the 1-D token array alone with numpy.save",
    ".arrow": "a `datasets` save_to_disk shard: export the dataset with to_parquet or to_json(lines=True)",
    ".pkl": "a pickle, which is never loaded (it can run code)",
    ".pickle": "a pickle, which is never loaded (it can run code)",
    ".pt": "a PyTorch file: save the token ids with numpy.save as a .npy file",
    ".pth": "a PyTorch file: save the token ids with numpy.save as a .npy file",
    ".safetensors": "a tensor archive: save the token ids with numpy.save as a .npy file",
    **{s: "compressed: decompress it first" for s in (".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".7z")},
}
# Inside a directory of text files these are token files, not text.
_REFUSED_IN_DIRS = {".npy": "a token file: give it alone as data.corpus", **_REFUSED}

# Documents' separators, by the names tokenizers commonly give their end-of-text token (first found wins).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "[SEP]")

# Text is encoded in pieces of at least this many characters (a tokenizer's
# Encoding of a whole book-sized text costs many times its size in memory, and
# pieces are encoded in parallel). Read at call time, so tests can shrink it.
TEXT_PIECE_CHARS = 1 << 20


def refusal(name: str, in_dir: bool = False) -> str | None:
    """Why a file called ``name`` is not read as a corpus (None: it is fine)."""
    suffix = Path(name).suffix.lower()
    return (_REFUSED_IN_DIRS if in_dir else _REFUSED).get(suffix)


# ---- token arrays --------------------------------------------------------------------------


def open_npy(path: Path) -> np.ndarray:
    """The 1-D integer array of a ``.npy`` file, memory-mapped (only the header is read here)."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"corpus: {path}: not a readable .npy token array ({e})") from None
    require(tokens.ndim == 1, "corpus", f"{path}: the token array is {tokens.ndim}-D with shape {tokens.shape}; "
            "it must be 1-D (save tokens.reshape(-1))")
    require(tokens.dtype.kind in "iu", "corpus", f"{path}: dtype {tokens.dtype} is not an integer type; "
            "token ids must be integers (uint8..uint64, int8..int64)")
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    """Every id is in 0..vocab_size-1 (reads the whole array once)."""
    if tokens.dtype.kind == "i":
        low = int(tokens.min())
        require(low >= 0, "corpus", f"{name}: contains negative token id {low}")
    top = int(tokens.max())
    require(top < vocab_size, "vocab_size", f"{name}: contains token id {top}, but vocab_size is {vocab_size}")


# ---- tokenizers ----------------------------------------------------------------------------


def load_tokenizer(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from its JSON file, with truncation and padding off."""
    p = Path(path)
    require(p.is_file(), "tokenizer", f"{p}: no such file")
    require(p.suffix.lower() == ".json", "tokenizer",
            f"{p}: expected a Hugging Face `tokenizers` JSON file (tokenizer.json); "
            "a sentencepiece .model or a vocab.txt is not one")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"tokenizer: needs the `tokenizers` package: {TEXT_INSTALL}") from None
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises plain Exception for a malformed file
        raise ConfigError(f"tokenizer: {p}: not a readable tokenizers JSON file ({e})") from None
    # A tokenizer.json made for inference may cut every input at 512 tokens or pad it:
    # on a corpus that would silently drop or invent text.
    tok.no_truncation()
    tok.no_padding()
    return tok


def tokenizer_vocab_size(tok: Any) -> int:
    """How many ids the tokenizer can produce (added tokens included; their ids may lie past the base size)."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def token_dtype(tok: Any) -> np.dtype:
    """The smallest unsigned dtype that holds every id of ``tok``."""
    return np.dtype(np.uint16 if tokenizer_vocab_size(tok) <= 1 << 16 else np.uint32)


def separator_ids(tok: Any) -> list[int]:
    """What goes between two documents: the end-of-text token if the tokenizer has one, else "\\n\\n" encoded
    (which may be nothing, for a tokenizer that drops whitespace)."""
    for name in EOS_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return [i]
    return list(tok.encode("\n\n", add_special_tokens=False).ids)


def text_pieces(text: str, piece_chars: int) -> list[str]:
    """``text`` cut into pieces of at least ``piece_chars`` characters (the last may be shorter).

    Each cut is right after a newline that has a non-space character on both
    sides: there common pre-tokenizers (byte-level, whitespace, BERT) split
    anyway, so the pieces' tokens equal the whole text's. A text with no such
    newline past ``piece_chars`` stays one piece.
    """
    pieces, start = [], 0
    while start < len(text):
        cut = _seam(text, start + piece_chars) if start + piece_chars < len(text) else len(text)
        pieces.append(text[start:cut])
        start = cut
    return pieces


def _seam(text: str, pos: int) -> int:
    p = text.find("\n", pos)
    while p != -1:
        if 0 < p < len(text) - 1 and not text[p - 1].isspace() and not text[p + 1].isspace():
            return p + 1
        p = text.find("\n", p + 1)
    return len(text)


def encode_texts(tok: Any, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Each text's token ids. The post-processor's special tokens (BOS, [CLS]) are not added: the
    caller puts the separator between documents."""
    pieces, owner = [], []
    for i, text in enumerate(texts):
        split = text_pieces(text, TEXT_PIECE_CHARS)
        pieces += split
        owner += [i] * len(split)
    # encode_batch_fast (tokenizers >= 0.20) skips the offsets nobody here reads.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    out: list[list[np.ndarray]] = [[] for _ in texts]
    for i, enc in zip(owner, encode(pieces, add_special_tokens=False)):
        out[i].append(np.asarray(enc.ids, dtype=dtype))
    return [np.concatenate(p) if p else np.zeros(0, dtype) for p in out]


def decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"corpus: {where}: not UTF-8 text (byte {e.start}); a tokenizer reads text, "
                          "so remove the file or leave data.tokenizer empty to read bytes") from None


def whole_utf8(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut off at its end (by a byte cap)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # the lead byte of the last character
            need = 1 if b < 0x80 else 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2
            return data[:-back] if need > back else data
    return data


# ---- dataset records -----------------------------------------------------------------------


def probe_records(path: Path, field: str) -> None:
    """Cheap checks of a ``.jsonl``/``.parquet`` file before any process starts: the package to read it is
    there, and its first record (jsonl) or its schema (parquet) has a string ``field``."""
    if path.suffix.lower() == ".parquet":
        _parquet_column(path, field)
        return
    for _ in _jsonl_records(path, field):
        return


def read_records(path: Path, field: str) -> Iterator[tuple[str, bytes]]:
    """(where, UTF-8 text) of each non-empty record; ``where`` is ``file:line`` or ``file row N``."""
    if path.suffix.lower() == ".parquet":
        return _parquet_records(path, field)
    return _jsonl_records(path, field)


def _jsonl_records(path: Path, field: str) -> Iterator[tuple[str, bytes]]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue  # a trailing or stray blank line is not a record
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ConfigError(f"corpus: {where}: malformed JSON line ({e})") from None
            require(isinstance(record, dict), "corpus", f"{where}: expected a JSON object, got {_json_type(record)}")
            require(field in record, "text_field", f"{where}: no field {field!r} (fields: "
                    f"{', '.join(sorted(record))[:200]}); set data.text_field")
            text = record[field]
            require(isinstance(text, str), "text_field",
                    f"{where}: field {field!r} is {_json_type(text)}, not a string")
            if text:
                yield where, _utf8_bytes(text, where)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _utf8_bytes(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # JSON may spell a lone surrogate (\ud800), which no UTF-8 text holds
        raise ConfigError(f"corpus: {where}: the text holds a lone surrogate, which is not valid Unicode") from None


def _parquet_column(path: Path, field: str) -> Any:
    """The opened ``pyarrow.parquet.ParquetFile`` after checking its ``field`` column is a string column."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"corpus: {path}: reading parquet needs the `pyarrow` package: {DATA_INSTALL}") from None
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
        raise ConfigError(f"corpus: {path}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    require(schema.get_field_index(field) >= 0, "text_field",
            f"{path}: no column {field!r} (columns: {', '.join(schema.names)[:200]}); set data.text_field")
    typ = schema.field(field).type
    string = pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view",
                                                                                 lambda t: False)(typ)
    require(string, "text_field", f"{path}: column {field!r} has type {typ}, not string")
    return pf


def _parquet_records(path: Path, field: str) -> Iterator[tuple[str, bytes]]:
    pf = _parquet_column(path, field)
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        texts = batch.column(0).to_pylist()
        for text in texts:
            require(text is not None, "text_field", f"{path} row {row}: field {field!r} is null, not a string")
            if text:
                yield f"{path} row {row}", text.encode("utf-8")
            row += 1


__all__ = ["DATA_INSTALL", "EOS_NAMES", "RECORD_SUFFIXES", "TEXT_INSTALL", "check_token_ids", "decode_utf8",
           "encode_texts", "load_tokenizer", "open_npy", "probe_records", "read_records", "refusal",
           "separator_ids", "text_pieces", "token_dtype", "tokenizer_vocab_size", "whole_utf8"]
