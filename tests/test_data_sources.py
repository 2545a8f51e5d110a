"""Corpora beyond bytes: .npy and .bin token files, text through a `tokenizers` tokenizer, .jsonl and
.parquet dataset files and directories of them. Every fixture is made here in tmp_path (the tokenizers
are trained in the test, nothing is downloaded)."""
import json
import sys

import numpy as np
import pytest

from wan_diloco import data as d
from wan_diloco import data_sources as sources
from wan_diloco.config import ConfigError

# Varied whitespace, indentation, blank lines and non-ASCII text: where chunked encoding would go wrong.
DOCS = [
    "The quick brown fox jumps over the lazy dog.\nIt was not amused.",
    "def f(x):\n    return x + 1\n\n\nprint(f(2))\n",
    "Ünïcödé text: 中文字符 and emoji-free accents, café crème.",
    "  leading spaces\n\tand a tab\n   \n trailing   ",
    "Short one.",
    "Numbers 12345 and 678.90; punctuation!? (yes) [no] {maybe}",
    "Line one\nLine two\nLine three\nLine four\nLine five\nLine six",
    "Another document about foxes, dogs and lazy afternoons.",
    "x = [i * i for i in range(10)]\nassert x[3] == 9\n",
    "The end. The very end.\n",
]
EOS = "<|endoftext|>"


def _train_bpe(special: list[str]):
    tk = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    # GPT-2's layout: byte-level, no prefix space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer, its JSON path): byte-level BPE with an end-of-text token."""
    tok = _train_bpe([EOS])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


@pytest.fixture(scope="module")
def bpe_no_eos(tmp_path_factory):
    tok = _train_bpe([])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


@pytest.fixture(scope="module")
def pq():
    pytest.importorskip("pyarrow")
    import pyarrow.parquet

    return pyarrow.parquet


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text).ids


def _joined(tok, docs: list[str], sep: list[int]) -> list[int]:
    out: list[int] = []
    for i, doc in enumerate(docs):
        out += (sep if i else []) + _ids(tok, doc)
    return out


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(docs)))
    return path


def _split(docs: list[str], n: int) -> tuple[list[str], list[str]]:
    return [t for i, t in enumerate(docs) if i % n != n - 1], [t for i, t in enumerate(docs) if i % n == n - 1]


# ---- .npy and .bin token files -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64", "int16", "int32", "int64"])
def test_npy_tokens_of_every_integer_dtype(tmp_path, dtype):
    ids = (np.arange(1000) * 7 % 251).astype(dtype)
    path = tmp_path / "tokens.npy"
    np.save(path, ids)
    c = d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=251, eval_fraction=0.1))
    assert isinstance(c.train.base if c.train.base is not None else c.train, np.memmap)  # not read into memory
    assert c.train.dtype == np.dtype(dtype)
    assert np.array_equal(c.train, ids[:900]) and np.array_equal(c.eval, ids[900:])
    assert c.truncated == "" and c.name == str(path)


def test_npy_cap_and_vocabulary(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(1000, dtype=np.uint32))
    c = d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=1000, max_bytes=400, eval_fraction=0.1))
    assert len(c.train) + len(c.eval) == 100 and np.array_equal(c.eval, np.arange(90, 100))
    assert c.truncated == f"max_bytes=400 read the first 100 of 1000 tokens of {path}"
    with pytest.raises(ConfigError, match=r"vocab_size: .*t\.npy: contains token id 999, but vocab_size is 512"):
        d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=512))
    with pytest.raises(ConfigError, match="less than one 4-byte token"):
        d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=1000, max_bytes=3))


@pytest.mark.parametrize("array,message", [
    (np.arange(10, dtype=np.float32), r"dtype float32 is not an integer type"),
    (np.zeros((4, 8), dtype=np.int32), r"the token array is 2-D with shape \(4, 8\); it must be 1-D"),
    (np.int64(3), r"the token array is 0-D"),
    (np.array([True, False] * 50), r"dtype bool is not an integer type"),
    (np.array([5, 3, -1, 7] * 30, dtype=np.int16), r"contains negative token id -1"),
    (np.zeros(0, dtype=np.uint16), r"empty token file"),
])
def test_npy_refused(tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ConfigError, match=rf"corpus: {path}: {message}"):
        d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=1000))


def test_npy_shape_and_dtype_are_checked_before_any_process_starts(tmp_path):
    # check_corpus reads the header only: a float file is refused there, a negative id only at load.
    floats, negative = tmp_path / "f.npy", tmp_path / "n.npy"
    np.save(floats, np.zeros(10, dtype=np.float64))
    np.save(negative, np.array([1, -2, 3] * 50, dtype=np.int32))
    with pytest.raises(ConfigError, match="float64 is not an integer type"):
        d.check_corpus(d.DataConfig(corpus=str(floats), vocab_size=1000))
    d.check_corpus(d.DataConfig(corpus=str(negative), vocab_size=1000))
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ConfigError, match=r"junk\.npy: not a readable \.npy token array"):
        d.check_corpus(d.DataConfig(corpus=str(tmp_path / "junk.npy"), vocab_size=1000))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "int32"])
def test_bin_token_dtypes(tmp_path, dtype):
    ids = (np.arange(400) % 200).astype(dtype)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    c = d.load_corpus(d.DataConfig(corpus=str(path), token_dtype=dtype, vocab_size=200, eval_fraction=0.25))
    assert c.train.dtype == np.dtype(dtype) and np.array_equal(np.concatenate([c.train, c.eval]), ids)
    assert np.array_equal(c.eval, ids[300:])


def test_bin_negative_ids_and_cap(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, -5, 3] * 25, dtype=np.int32).tofile(path)
    with pytest.raises(ConfigError, match=r"t\.bin: contains negative token id -5"):
        d.load_corpus(d.DataConfig(corpus=str(path), token_dtype="int32", vocab_size=10))
    np.arange(100, dtype=np.uint16).tofile(path)
    c = d.load_corpus(d.DataConfig(corpus=str(path), vocab_size=100, max_bytes=100, eval_fraction=0.1))
    assert len(c.train) + len(c.eval) == 50
    assert c.truncated == f"max_bytes=100 read the first 50 of 100 tokens of {path}"


def test_a_tokenizer_is_refused_for_token_files(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"tokenizer: .*t\.npy already holds token ids"):
        d.check_corpus(d.DataConfig(corpus=str(path), tokenizer=str(tmp_path / "tokenizer.json"), vocab_size=100))


# ---- text through a tokenizer --------------------------------------------------------------------


def test_text_file_through_a_tokenizer_is_exactly_its_encoding(tmp_path, bpe, monkeypatch):
    tok, tok_path = bpe
    text = "\n".join(DOCS * 4)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    cfg = d.DataConfig(corpus=str(path), tokenizer=tok_path, vocab_size=tok.get_vocab_size(), eval_fraction=0.2)
    want = np.array(_ids(tok, text))
    c = d.load_corpus(cfg)
    assert c.train.dtype == np.uint16  # a 400-token vocabulary fits
    assert np.array_equal(np.concatenate([c.train, c.eval]), want)
    assert len(c.eval) == int(len(want) * 0.2) > 0
    # Encoded in many small pieces (as a large file is), the stream is still the whole text's encoding.
    monkeypatch.setattr(sources, "TEXT_PIECE_CHARS", 40)
    assert len(sources.text_pieces(text, 40)) > 10
    again = d.load_corpus(cfg)
    assert np.array_equal(np.concatenate([again.train, again.eval]), want)


def test_text_pieces_cut_only_between_non_space_characters():
    text = "ab\ncd\n  ef\n\ngh\nij \nkl\nmn"
    pieces = sources.text_pieces(text, 3)
    assert "".join(pieces) == text and len(pieces) > 2
    for left, right in zip(pieces, pieces[1:]):
        assert left.endswith("\n") and not left[-2].isspace() and not right[0].isspace()
    assert sources.text_pieces("no newline at all " * 10, 5) == ["no newline at all " * 10]
    assert sources.text_pieces("", 5) == []


def test_capped_text_file_through_a_tokenizer_drops_a_cut_character(tmp_path, bpe):
    tok, tok_path = bpe
    text = "ab" + "é" * 200  # é is two bytes: a cap of 5 bytes falls inside the second
    path = tmp_path / "t.txt"
    path.write_text(text)
    c = d.load_corpus(d.DataConfig(corpus=str(path), tokenizer=tok_path, vocab_size=400, max_bytes=101,
                                   eval_fraction=0.3))
    assert np.array_equal(np.concatenate([c.train, c.eval]), _ids(tok, "ab" + "é" * 49))
    assert c.truncated == f"max_bytes=101 read the first 101 of {len(text.encode())} bytes of {path}"
    assert sources.whole_utf8("aé".encode()[:2]) == b"a" and sources.whole_utf8("aé".encode()) == "aé".encode()
    assert sources.whole_utf8("a中".encode()[:3]) == b"a" and sources.whole_utf8(b"abc") == b"abc"


def test_text_directory_through_a_tokenizer(tmp_path, bpe):
    tok, tok_path = bpe
    for i, text in enumerate(DOCS[:6]):
        (tmp_path / f"doc{i}.txt").write_text(text)
    c = d.load_corpus(d.DataConfig(corpus=str(tmp_path), tokenizer=tok_path, vocab_size=400, eval_every_nth_file=3))
    assert c.train_files == ("doc0.txt", "doc1.txt", "doc3.txt", "doc4.txt")
    assert c.eval_files == ("doc2.txt", "doc5.txt")
    eos = [tok.token_to_id(EOS)]
    train, held = _split(DOCS[:6], 3)
    assert c.train.tolist() == _joined(tok, train, eos) and c.eval.tolist() == _joined(tok, held, eos)


def test_a_file_that_is_not_utf8_is_named(tmp_path, bpe):
    (tmp_path / "a.txt").write_text("fine text\n" * 5)
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match=r"corpus: .*b\.bin: not UTF-8 text \(byte 0\)"):
        d.load_corpus(d.DataConfig(corpus=str(tmp_path), tokenizer=bpe[1], vocab_size=400, eval_every_nth_file=2))


def test_stdlib_through_a_tokenizer(bpe):
    tok, tok_path = bpe
    c = d.load_corpus(d.DataConfig(tokenizer=tok_path, vocab_size=400, max_bytes=60_000, eval_every_nth_file=2))
    first = (d.stdlib_root() / c.train_files[0]).read_text()
    assert c.train[: len(_ids(tok, first))].tolist() == _ids(tok, first)
    assert c.train.max() < 400 and len(c.eval) > 0


def test_the_separator_is_an_end_of_text_token_or_a_blank_line(bpe, bpe_no_eos):
    assert sources.separator_ids(bpe[0]) == [bpe[0].token_to_id(EOS)]
    assert sources.separator_ids(bpe_no_eos[0]) == _ids(bpe_no_eos[0], "\n\n") != []
    for name in ("</s>", "[SEP]"):
        tok = _train_bpe([name])
        assert sources.separator_ids(tok) == [tok.token_to_id(name)]


def test_a_tokenizer_made_for_inference_neither_truncates_nor_decorates_the_corpus(tmp_path, monkeypatch):
    tok = _train_bpe([EOS, "<s>"])  # skips without `tokenizers`
    from tokenizers.processors import TemplateProcessing

    tok.enable_truncation(max_length=8)
    tok.enable_padding(length=16)
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    text = "\n".join(DOCS)
    (tmp_path / "c.txt").write_text(text)
    monkeypatch.setattr(sources, "TEXT_PIECE_CHARS", 100)  # a BOS per piece would show
    c = d.load_corpus(d.DataConfig(corpus=str(tmp_path / "c.txt"), tokenizer=str(tmp_path / "tokenizer.json"),
                                   vocab_size=400, eval_fraction=0.1))
    want = tok.encode(text, add_special_tokens=False).ids
    assert np.concatenate([c.train, c.eval]).tolist() == want and len(want) > 16
    assert tok.token_to_id("<s>") not in want


def test_tokenizer_errors(tmp_path, bpe, monkeypatch):
    text = tmp_path / "c.txt"
    text.write_text("some text\n" * 50)
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"tokenizer: {missing}: no such file"):
        d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=str(missing), vocab_size=400))
    sp = tmp_path / "tokenizer.model"
    sp.write_bytes(b"\x00")
    with pytest.raises(ConfigError, match=r"expected a Hugging Face `tokenizers` JSON file"):
        d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=str(sp), vocab_size=400))
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0"}')
    with pytest.raises(ConfigError, match=r"broken\.json: not a readable tokenizers JSON file"):
        d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=str(broken), vocab_size=400))
    n = bpe[0].get_vocab_size()
    with pytest.raises(ConfigError, match=rf"vocab_size: 300 is smaller than the {n} tokens of the tokenizer "
                                          rf".*; set model.vocab_size >= {n}"):
        d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=bpe[1], vocab_size=300))
    d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=bpe[1], vocab_size=n))  # small vocabularies are fine
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"^tokenizer: needs the `tokenizers` package: "
                                          r"pip install 'wan-diloco\[text\]'$"):
        d.check_corpus(d.DataConfig(corpus=str(text), tokenizer=bpe[1], vocab_size=n))


def test_the_missing_package_message_needs_no_package(tmp_path, monkeypatch):
    # Runs where `tokenizers` is not installed too: the message is what a user without it sees.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "c.txt").write_text("text")
    with pytest.raises(ConfigError, match=r"needs the `tokenizers` package: pip install 'wan-diloco\[text\]'"):
        d.load_corpus(d.DataConfig(corpus=str(tmp_path / "c.txt"), tokenizer=str(tmp_path / "tokenizer.json")))


# ---- .jsonl and .parquet dataset files ---------------------------------------------------------------


def test_jsonl_as_bytes(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "data.jsonl", DOCS[:4] + [""] + DOCS[4:])  # an empty text is no document
    c = d.load_corpus(d.DataConfig(corpus=str(path), eval_every_nth_file=4))
    train, held = _split(DOCS, 4)
    assert bytes(c.train) == b"\n\n".join(t.encode() for t in train)
    assert bytes(c.eval) == b"\n\n".join(t.encode() for t in held) and len(held) == 2
    assert c.train.dtype == np.uint8 and c.truncated == "" and c.name == str(path)
    monkeypatch.setattr(d, "_ENCODE_BATCH_BYTES", 1)  # one document per batch
    batched = d.load_corpus(d.DataConfig(corpus=str(path), eval_every_nth_file=4))
    assert np.array_equal(c.train, batched.train) and np.array_equal(c.eval, batched.eval)


def test_jsonl_through_a_tokenizer(tmp_path, bpe, monkeypatch):
    tok, tok_path = bpe
    path = _write_jsonl(tmp_path / "data.jsonl", DOCS, field="content")
    cfg = d.DataConfig(corpus=str(path), tokenizer=tok_path, vocab_size=400, text_field="content",
                       eval_every_nth_file=3)
    c = d.load_corpus(cfg)
    eos = [tok.token_to_id(EOS)]
    train, held = _split(DOCS, 3)
    assert c.train.tolist() == _joined(tok, train, eos) and c.eval.tolist() == _joined(tok, held, eos)
    again = d.load_corpus(cfg)
    assert np.array_equal(c.train, again.train) and np.array_equal(c.eval, again.eval)
    # Tokenized in many small batches (as a large corpus is), the streams are the same.
    monkeypatch.setattr(d, "_ENCODE_BATCH_BYTES", 40)
    batched = d.load_corpus(cfg)
    assert np.array_equal(c.train, batched.train) and np.array_equal(c.eval, batched.eval)


def test_parquet_through_a_tokenizer_without_eos(tmp_path, bpe_no_eos, pq):
    import pyarrow as pa

    tok, tok_path = bpe_no_eos
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), path, row_group_size=3)
    c = d.load_corpus(d.DataConfig(corpus=str(path), tokenizer=tok_path, vocab_size=400, eval_every_nth_file=5))
    sep = _ids(tok, "\n\n")
    train, held = _split(DOCS, 5)
    assert c.train.tolist() == _joined(tok, train, sep) and c.eval.tolist() == _joined(tok, held, sep)


def test_a_dataset_directory_holds_out_every_nth_record_across_its_files(tmp_path, bpe, pq):
    import pyarrow as pa

    tok, tok_path = bpe
    shards = [DOCS[:4], DOCS[4:7]]
    for i, docs in enumerate(shards):
        pq.write_table(pa.table({"text": docs}), tmp_path / f"train-{i:05d}-of-00002.parquet")
    (tmp_path / "extra").mkdir()
    _write_jsonl(tmp_path / "extra" / "more.jsonl", DOCS[7:])
    (tmp_path / "README.md").write_text("# a dataset card: not read")
    (tmp_path / "dataset_info.json").write_text("{}")
    cfg = d.DataConfig(corpus=str(tmp_path), tokenizer=tok_path, vocab_size=400, eval_every_nth_file=4)
    c = d.load_corpus(cfg)
    # Sorted order: extra/more.jsonl (DOCS[7:]) before the parquet shards; records counted across files.
    order = DOCS[7:] + DOCS[:7]
    train, held = _split(order, 4)
    eos = [tok.token_to_id(EOS)]
    assert c.train.tolist() == _joined(tok, train, eos) and c.eval.tolist() == _joined(tok, held, eos)
    assert len(held) == 2 and c.train_files == c.eval_files == ()
    c2 = d.load_corpus(cfg)
    assert np.array_equal(c.train, c2.train) and np.array_equal(c.eval, c2.eval)
    bytes_corpus = d.load_corpus(d.DataConfig(corpus=str(tmp_path), eval_every_nth_file=4))
    assert bytes(bytes_corpus.eval) == b"\n\n".join(t.encode() for t in held)


def test_max_bytes_drops_whole_records_and_says_where(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ["a" * 100] * 10)
    c = d.load_corpus(d.DataConfig(corpus=str(path), max_bytes=450, eval_every_nth_file=2))
    assert bytes(c.train) == b"\n\n".join([b"a" * 100] * 2) and bytes(c.eval) == b"\n\n".join([b"a" * 100] * 2)
    assert c.truncated == f"max_bytes=450 stopped reading at {path}:5 after 4 documents (400 bytes)"
    with pytest.raises(ConfigError, match=r"eval_every_nth_file: .*1 documents read, so holding out every 2th "
                                          r"document gives no eval data \(max_bytes=150 stopped .*raise max_bytes\)"):
        d.load_corpus(d.DataConfig(corpus=str(path), max_bytes=150, eval_every_nth_file=2))


def test_eval_is_never_empty(tmp_path):
    path = _write_jsonl(tmp_path / "few.jsonl", DOCS[:3])
    with pytest.raises(ConfigError, match=rf"eval_every_nth_file: {path}: 3 documents read, so holding out every "
                                          r"10th document gives no eval data; lower eval_every_nth_file"):
        d.load_corpus(d.DataConfig(corpus=str(path)))
    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(ConfigError, match=rf"corpus: {empty}: no non-empty documents"):
        d.load_corpus(d.DataConfig(corpus=str(empty)))


@pytest.mark.parametrize("lines,message", [
    (['{"text": "ok"}', '{"text": "broken'], r"corpus: {f}:2: malformed JSON line"),
    (['{"text": "ok"}', '', '{"body": "x", "id": 1}'], r"text_field: {f}:3: no field 'text' \(fields: body, id\); "
                                                        r"set data.text_field"),
    (['{"text": 42}'], r"text_field: {f}:1: field 'text' is a number, not a string"),
    (['{"text": null}'], r"text_field: {f}:1: field 'text' is null, not a string"),
    (['["text"]'], r"corpus: {f}:1: expected a JSON object, got an array"),
    (['{"text": "\\ud800"}'], r"corpus: {f}:1: the text holds a lone surrogate"),
])
def test_bad_jsonl_lines_are_named(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message.format(f=path)):
        d.load_corpus(d.DataConfig(corpus=str(path), eval_every_nth_file=2))


def test_check_corpus_reads_only_the_first_jsonl_record(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    with open(path, "a") as f:
        f.write("{oops\n")
    d.check_corpus(d.DataConfig(corpus=str(path)))  # cheap: the bad line 11 is found at load
    with pytest.raises(ConfigError, match=rf"{path}:11: malformed JSON"):
        d.load_corpus(d.DataConfig(corpus=str(path)))
    with pytest.raises(ConfigError, match=rf"text_field: {path}:1: no field 'body'"):
        d.check_corpus(d.DataConfig(corpus=str(path), text_field="body"))


def test_bad_parquet_is_named(tmp_path, pq):
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), path)
    with pytest.raises(ConfigError, match=rf"text_field: {path}: no column 'text' \(columns: content, n\)"):
        d.check_corpus(d.DataConfig(corpus=str(path)))
    with pytest.raises(ConfigError, match=rf"text_field: {path}: column 'n' has type int64, not string"):
        d.check_corpus(d.DataConfig(corpus=str(path), text_field="n"))
    pq.write_table(pa.table({"text": ["a", "b", None, "c"]}), path)
    with pytest.raises(ConfigError, match=rf"text_field: {path} row 2: field 'text' is null, not a string"):
        d.load_corpus(d.DataConfig(corpus=str(path), eval_every_nth_file=2))
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=rf"corpus: {path}: not a readable parquet file"):
        d.check_corpus(d.DataConfig(corpus=str(path)))


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"corpus: .*train-00000-of-00001\.parquet: reading parquet needs the "
                                          r"`pyarrow` package: pip install 'wan-diloco\[data\]'"):
        d.check_corpus(d.DataConfig(corpus=str(tmp_path)))


# ---- what is refused up front ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,message", [
    ("tokens.npz", "an archive of arrays"), ("corpus.txt.gz", "compressed: decompress it first"),
    ("data-00000-of-00001.arrow", "a `datasets` save_to_disk shard"), ("ids.pkl", "a pickle, which is never loaded"),
])
def test_unsupported_files_are_refused(tmp_path, name, message):
    path = tmp_path / name
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match=rf"corpus: {path}: not a supported corpus file: {message}"):
        d.check_corpus(d.DataConfig(corpus=str(path)))


def test_a_text_directory_holding_token_files_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    np.save(tmp_path / "tokens.npy", np.arange(10))
    with pytest.raises(ConfigError, match=rf"corpus: {tmp_path}: holds tokens.npy, a token file: give it alone"):
        d.check_corpus(d.DataConfig(corpus=str(tmp_path)))
    (tmp_path / "tokens.npy").unlink()
    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match=r"holds data-00000-of-00001.arrow, a `datasets` save_to_disk shard"):
        d.check_corpus(d.DataConfig(corpus=str(tmp_path)))
