import numpy as np
import pytest

from wan_diloco import data as d
from wan_diloco.config import ConfigError, from_mapping


@pytest.fixture(scope="module")
def stdlib():
    return d.load_corpus(d.DataConfig())


def test_stdlib_corpus_loads(stdlib):
    assert stdlib.name.startswith("stdlib-")
    assert len(stdlib.train) > 1_000_000 and len(stdlib.eval) > 50_000
    assert stdlib.train.ndim == 1 and stdlib.train.max() < 256
    assert all(f.endswith(".py") for f in stdlib.train_files + stdlib.eval_files)
    assert not any("site-packages" in f or f.startswith("test/") for f in stdlib.train_files)
    # The stream is the files' bytes concatenated in sorted path order.
    first = (d.stdlib_root() / stdlib.train_files[0]).read_bytes()
    assert bytes(stdlib.train[: len(first)]) == first


def test_stdlib_deterministic_and_disjoint(stdlib):
    again = d.load_corpus(d.DataConfig())
    assert np.array_equal(stdlib.train, again.train) and np.array_equal(stdlib.eval, again.eval)
    assert not set(stdlib.train_files) & set(stdlib.eval_files)
    n = len(stdlib.train_files) + len(stdlib.eval_files)
    assert len(stdlib.eval_files) == n // 10


def test_max_bytes_caps_corpus(stdlib):
    small = d.load_corpus(d.DataConfig(max_bytes=2_000_000))
    assert len(small.train) + len(small.eval) <= 2_000_000
    # The cut is told, with where it stopped; the default (0) reads everything and says nothing.
    assert small.truncated.startswith("max_bytes=2000000 stopped reading at ") and "files" in small.truncated
    assert d.DataConfig().max_bytes == 0 and stdlib.truncated == ""


def test_shards_disjoint_and_cover():
    train = np.arange(1003)
    shards = [d.shard(train, i, 4) for i in range(4)]
    assert np.array_equal(np.concatenate([s.tokens for s in shards]), train)
    assert max(len(s.tokens) for s in shards) - min(len(s.tokens) for s in shards) <= 1
    with pytest.raises(ConfigError, match="learner_id"):
        d.shard(train, 4, 4)


def test_interleaved_shards_disjoint_cover_and_span_the_corpus():
    train = np.arange(1003)
    shards = [d.shard(train, i, 4, block_tokens=10) for i in range(4)]
    together = np.sort(np.concatenate([s.tokens for s in shards]))
    assert np.array_equal(together, train)  # disjoint and complete
    for s in shards:  # each learner draws from the start and the end of the corpus
        assert s.tokens.min() < 40 and s.tokens.max() > 960
    with pytest.raises(ConfigError, match="block_tokens"):
        d.shard(train, 0, 4, block_tokens=-1)


def test_batches_shape_and_determinism():
    tokens = np.arange(500, dtype=np.uint16)
    a, b = d.batches(tokens, 4, 16, seed=7), d.batches(tokens, 4, 16, seed=7)
    for _ in range(3):
        x, y = next(a), next(b)
        assert x.tokens.shape == (4, 17) and x.tokens.dtype == np.int32 and x.n_tokens == 64
        assert np.array_equal(x.tokens, y.tokens)
        assert np.all(np.diff(x.tokens, axis=1) == 1)  # contiguous windows of the stream
    assert not np.array_equal(next(d.batches(tokens, 4, 16, seed=8)).tokens, next(a).tokens)


def test_batches_too_short_shard():
    with pytest.raises(ConfigError, match="seq_len"):
        next(d.batches(np.arange(10), 2, 16, seed=0))


def _marked_shards(n: int = 4, length: int = 200) -> list[np.ndarray]:
    return [np.full(length, m, dtype=np.uint16) for m in range(n)]  # a window shows which shard it came from


def test_failover_batches_without_failures_draw_only_their_own_shard():
    # The stream is pinned: uniform window starts from default_rng(seed), so runs stay reproducible.
    shards = [np.arange(500, dtype=np.uint16) + 1000 * m for m in range(3)]
    rng = np.random.default_rng(7)
    expected = [shards[1][rng.integers(0, 500 - 16, size=4)[:, None] + np.arange(17)] for _ in range(3)]
    a = d.FailoverBatches(shards, 1, 4, 16, seed=7)
    plain = d.batches(shards[1], 4, 16, seed=7)
    # Being told that you yourself are down changes nothing.
    for want, down in zip(expected, [frozenset(), frozenset({1}), frozenset()]):
        assert np.array_equal(a.next(down).tokens, want)
        assert np.array_equal(next(plain).tokens, want)


def test_failover_batches_keep_every_shard_at_the_same_rate():
    M, down, n = 4, frozenset({1, 3}), 4000
    live = [m for m in range(M) if m not in down]
    counts = np.zeros(M)
    for m in live:
        batch = d.FailoverBatches(_marked_shards(M), m, n, 8, seed=m).next(down)
        assert batch.tokens.shape == (n, 9) and batch.n_tokens == n * 8
        assert np.all(batch.tokens == batch.tokens[:, :1])  # each window from one shard
        src = np.bincount(batch.tokens[:, 0], minlength=M)
        assert set(np.nonzero(src)[0]) == {m, *down}  # own shard and the down ones, never another live one
        assert src[m] / n == pytest.approx(len(live) / M, abs=0.03)
        counts += src
    # Over the live learners every shard, down or not, is read 1/M of the time.
    assert counts / counts.sum() == pytest.approx(np.full(M, 1 / M), abs=0.02)


def test_failover_batches_bad_input():
    with pytest.raises(ConfigError, match="shard 2"):
        d.FailoverBatches([np.arange(100), np.arange(100), np.arange(5)], 0, 2, 16, seed=0)
    with pytest.raises(ConfigError, match="learner_id"):
        d.FailoverBatches(_marked_shards(2), 2, 2, 16, seed=0)
    fb = d.FailoverBatches(_marked_shards(2), 0, 2, 16, seed=0)
    with pytest.raises(ConfigError, match="down"):
        fb.next(frozenset({5}))


def test_eval_batches_fixed():
    tokens = np.arange(1000)
    ev = d.eval_batches(tokens, 4, 16, 3)
    assert len(ev) == 3 and all(b.shape == (4, 17) for b in ev)
    assert all(np.array_equal(x, y) for x, y in zip(ev, d.eval_batches(tokens, 4, 16, 3)))
    starts = np.concatenate([b[:, 0] for b in ev])
    assert starts[0] == 0 and starts[-1] == 1000 - 17 and np.all(np.diff(starts) > 0)


def test_text_directory(tmp_path):
    for i in range(6):
        (tmp_path / f"sub{i % 2}").mkdir(exist_ok=True)
        (tmp_path / f"sub{i % 2}" / f"f{i}.txt").write_bytes(bytes([65 + i]) * 100)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref")
    (tmp_path / ".hidden").write_bytes(b"zz")
    c = d.load_corpus(d.DataConfig(corpus=str(tmp_path), eval_every_nth_file=3))
    # Sorted order: sub0/f0 f2 f4, sub1/f1 f3 f5; every third is held out.
    assert c.eval_files == ("sub0/f4.txt", "sub1/f5.txt")
    assert len(c.train) == 400 and len(c.eval) == 200
    assert bytes(c.eval[:100]) == b"E" * 100


def test_validation_holdout_never_reads_eval_and_is_disjoint_from_train(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_bytes(bytes([65 + i]) * 100)
    ev = d.load_corpus(d.DataConfig(corpus=str(tmp_path), eval_every_nth_file=3))
    val = d.load_corpus(d.DataConfig(corpus=str(tmp_path), eval_every_nth_file=3, holdout="validation"))
    assert ev.eval_files == ("f2.txt", "f5.txt", "f8.txt")
    # f2, f5, f8 set aside; of f0 f1 f3 f4 f6 f7 every third (f3, f7) is the validation split.
    assert val.eval_files == ("f3.txt", "f7.txt") and val.train_files == ("f0.txt", "f1.txt", "f4.txt", "f6.txt")
    assert bytes(val.eval) == b"D" * 100 + b"H" * 100 and b"C" not in bytes(val.train) + bytes(val.eval)


def test_validation_holdout_of_a_token_file_is_the_tail_before_eval(tmp_path):
    p = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint32).tofile(p)
    c = d.load_corpus(d.DataConfig(corpus=str(p), token_dtype="uint32", vocab_size=1000, eval_fraction=0.1,
                                   holdout="validation"))
    assert np.array_equal(c.train, np.arange(800)) and np.array_equal(c.eval, np.arange(800, 900))
    with pytest.raises(ConfigError, match="holdout='validation'"):
        d.load_corpus(d.DataConfig(corpus=str(p), token_dtype="uint32", vocab_size=1000, eval_fraction=0.5,
                                   holdout="validation"))


def test_single_text_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(bytes(range(256)) * 4)
    c = d.load_corpus(d.DataConfig(corpus=str(p), eval_fraction=0.25))
    assert len(c.train) == 768 and len(c.eval) == 256 and bytes(c.eval) == bytes(range(256))


def test_bin_tokens(tmp_path):
    p = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint32).tofile(p)
    c = d.load_corpus(d.DataConfig(corpus=str(p), token_dtype="uint32", vocab_size=1000, eval_fraction=0.1))
    assert np.array_equal(c.train, np.arange(900)) and np.array_equal(c.eval, np.arange(900, 1000))
    with pytest.raises(ConfigError, match="token id 999.*vocab_size is 512"):
        d.load_corpus(d.DataConfig(corpus=str(p), token_dtype="uint32", vocab_size=512))


def test_bin_size_not_multiple_of_dtype(tmp_path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="multiple of uint16"):
        d.load_corpus(d.DataConfig(corpus=str(p)))


@pytest.mark.parametrize("kind", ["missing", "empty_file", "empty_dir", "empty_bin"])
def test_missing_or_empty_corpus(tmp_path, kind):
    path = {"missing": tmp_path / "nope", "empty_file": tmp_path / "e.txt",
            "empty_dir": tmp_path / "dir", "empty_bin": tmp_path / "e.bin"}[kind]
    if kind == "empty_dir":
        path.mkdir()
    elif kind != "missing":
        path.write_bytes(b"")
    with pytest.raises(ConfigError, match=str(path)):
        d.load_corpus(d.DataConfig(corpus=str(path)))


def test_too_few_files_for_eval(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    with pytest.raises(ConfigError, match="eval_every_nth_file"):
        d.load_corpus(d.DataConfig(corpus=str(tmp_path)))


@pytest.mark.parametrize("bad,field", [({"max_bytes": -1}, "max_bytes"), ({"eval_fraction": 1.0}, "eval_fraction"),
                                       ({"token_dtype": "int8"}, "token_dtype"),
                                       ({"token_dtype": "float32"}, "token_dtype"), ({"text_field": ""}, "text_field"),
                                       ({"eval_every_nth_file": 1}, "eval_every_nth_file"),
                                       ({"holdout": "test"}, "holdout")])
def test_config_validation(bad, field):
    with pytest.raises(ConfigError, match=field):
        from_mapping(d.DataConfig, bad)
    with pytest.raises(ConfigError, match=field):  # also when built in code, not from TOML
        d.DataConfig(**bad).validate()


def test_byte_corpus_needs_byte_vocab():
    with pytest.raises(ConfigError, match="vocab_size"):
        d.load_corpus(d.DataConfig(vocab_size=100))


def test_a_restored_position_gives_the_same_batches_again():
    import json

    shards = [np.arange(1000, dtype=np.uint16) % 251, np.arange(1000, dtype=np.uint16) % 241]
    a = d.FailoverBatches(shards, 1, 4, 8, seed=3)
    a.next()
    pos = json.loads(json.dumps(a.position()))  # it travels as JSON in a snapshot part
    want = [a.next().tokens for _ in range(3)]
    b = d.FailoverBatches(shards, 1, 4, 8, seed=99)
    b.restore(pos)
    assert b.drawn == 1  # how far into the stream it is travels with the position
    assert all(np.array_equal(w, b.next().tokens) for w in want) and b.drawn == 4
    with pytest.raises(ValueError, match="learner 0"):
        d.FailoverBatches(shards, 0, 4, 8, seed=3).restore(pos)
    with pytest.raises(ValueError, match="data position"):
        b.restore({"learner": 1, "rng": {"bit_generator": "nope"}})
    for bad in (-1, "3", True, 2.5):
        with pytest.raises(ValueError, match="batches"):
            b.restore({**pos, "batches": bad})
    assert b.drawn == 4  # a refused position changes nothing
