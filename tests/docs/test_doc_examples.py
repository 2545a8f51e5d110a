"""A new user's path: the fenced blocks of docs/models.md, docs/data.md and docs/api.md, read from the markdown at
test time and used as printed, in a fresh folder.

The docs mark a block with an HTML comment on the line before its fence:
``<!-- file: NAME -->`` the block is a file the text tells the reader to save (written there first);
``<!-- not run: why -->`` it is not run here, for the reason given (output, a path on another host);
``<!-- run by tests/X.py -->`` another test runs it as printed.
Every other block is run: a TOML block is a run file that `launch` would accept (loaded with the real loader,
then checked as `launch` checks before any process starts), a Python block is executed, a bash block's commands
are run by bash. Whatever the marker, every TOML block loads, every Python block compiles, and every command line
parses with the CLI's own parser. What the examples presume the reader has (a previous run's folder, a corpus of
each kind under ``data/``) the test makes first, in :func:`presumed`.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from wan_diloco import spec as spec_lib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("models.md", "data.md", "api.md")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(file|not run|run by)\s*:?\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, counted from 1
    lang: str
    text: str
    mark: str  # "", "file", "not run" or "run by"
    arg: str  # the file's name, the reason, the test

    def __str__(self) -> str:
        return f"docs/{self.doc}:{self.line} ({self.lang or 'no language'})"


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of ``docs/doc`` with their markers; an indented block (in a list) loses its indent."""
    lines = (ROOT / "docs" / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            assert i + 1 < len(lines), f"docs/{doc}:{start + 1}: a fence that is never closed"
            body.append(lines[i][len(indent):])
            i += 1
        prev = next((x for x in reversed(lines[:start]) if x.strip()), "")
        mark = MARKER.match(prev)
        out.append(Block(doc, start + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else "",
                         mark.group(2) if mark else ""))
        i += 1
    return out


def presumed(doc: str, folder: Path) -> None:
    """What the examples of ``doc`` take the reader to have, made in ``folder``."""
    if doc == "models.md":
        from safetensors.numpy import save_file

        from wan_diloco import model, tree
        from wan_diloco.checkpoint import save_params

        rng = np.random.default_rng(7)  # trained weights of the tiny preset, as far as names and shapes go
        tiny = {n: rng.normal(0, 0.02, a.shape).astype(np.float32)
                for n, a in tree.flatten(model.abstract_params(model.preset("tiny"))).items()}
        save_params(folder / "runs/20260101-120000/checkpoints/params.safetensors", tiny)  # a previous run
        (folder / "pretrained").mkdir()
        save_file(tiny, str(folder / "pretrained/tiny.safetensors"))  # written by another framework
    elif doc == "data.md":
        make_corpora(folder / "data")


def make_corpora(data: Path) -> None:
    """A small corpus of each kind data.md's examples read, and a byte-level BPE tokenizer."""
    from tests.test_data_sources import DOCS as TEXTS, EOS, _train_bpe

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = [f"{TEXTS[i % len(TEXTS)]} (document {i})" for i in range(240)]
    (data / "books").mkdir(parents=True)
    _train_bpe([EOS]).save(str(data / "tokenizer.json"))
    (data / "shakespeare.txt").write_text("\n".join(docs))
    for i in range(40):
        (data / "books" / f"book-{i:02d}.txt").write_text("\n".join(docs[i::40]))
    (data / "corpus.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs[:50]))
    pq.write_table(pa.table({"text": docs[:50]}), data / "train-00000-of-00001.parquet")
    (data / "my_dataset").mkdir()
    for s in range(4):
        pq.write_table(pa.table({"text": docs[s::4]}), data / "my_dataset" / f"train-{s:05d}-of-00004.parquet")
    rng = np.random.default_rng(0)
    rng.integers(0, 50304, 20_000).astype(np.uint16).tofile(data / "train.bin")
    np.save(data / "tokens.npy", rng.integers(0, 128256, 20_000).astype(np.int32))
    np.save(data / "corpus.npy", rng.integers(0, 256, 20_000).astype(np.int32))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A fresh folder to work in, as a reader's own; cwd there for in-process blocks."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def setup_folder(doc: str, folder: Path) -> list[Block]:
    found = blocks(doc)
    presumed(doc, folder)
    for b in found:
        if b.mark == "file":
            (folder / b.arg).write_text(b.text)
    return found


def load_block(b: Block, folder: Path) -> spec_lib.RunSpec:
    path = folder / (b.arg if b.mark == "file" else f"{Path(b.doc).stem}-{b.line}.toml")
    path.write_text(b.text)
    try:
        return spec_lib.RunSpec.load(path)
    except Exception as e:
        raise AssertionError(f"{b}: {e}") from None


def command_lines(b: Block) -> list[list[str]]:
    return [shlex.split(x) for x in b.text.splitlines() if x.strip() and not x.lstrip().startswith("#")]


@pytest.mark.parametrize("doc", DOCS)
def test_every_block_is_marked_or_runnable_and_reads(doc, folder):
    from wan_diloco.cli import build_parser

    found = setup_folder(doc, folder)
    assert found, f"docs/{doc} has no fenced blocks"
    for b in found:
        assert b.lang in ("toml", "python", "bash") or b.mark == "not run", f"{b}: mark it <!-- not run: why -->"
        assert b.mark == "" or b.arg, f"{b}: <!-- {b.mark}: ... --> names nothing"
        if b.mark == "run by":
            assert str(Path("docs") / b.doc) in (ROOT / b.arg).read_text(), f"{b}: {b.arg} does not read docs/{doc}"
        if b.lang == "toml":
            load_block(b, folder)
        elif b.lang == "python":
            compile(b.text, str(b), "exec")
        elif b.lang == "bash":
            for argv in command_lines(b):
                assert argv[0] == "wan-diloco", f"{b}: {argv[0]}: not a wan-diloco command"
                build_parser().parse_args(argv[1:])  # a wrong flag exits 2 here


@pytest.mark.parametrize("doc", DOCS)
def test_the_run_files_and_python_run_as_printed(doc, folder, capsys):
    from wan_diloco.assemble import preflight
    from wan_diloco.data import load_corpus

    found = setup_folder(doc, folder)
    for b in (b for b in found if b.mark not in ("not run", "run by")):
        if b.lang == "toml":
            spec = load_block(b, folder)
            preflight(spec)  # what `launch` checks before any process starts: model, init, corpus
            if doc == "data.md":  # what each learner then reads
                c = load_corpus(spec.data)
                assert len(c.train) and len(c.eval), b
                assert int(max(c.train.max(), c.eval.max())) < spec.model.vocab_size, b
        elif b.lang == "python" and b.mark != "file":
            exec(compile(b.text, str(b), "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    if doc == "models.md":  # the model's tensor names and shapes, then the file's names: the same names
        assert "lm_head/kernel (" in out and "'lm_head/kernel'" in out
    if doc == "data.md":  # the tokenized dataset saved as ids, and its held-out share
        tokens = np.load(folder / "data/tokens.npy")
        share = float(re.search(r"eval_fraction = (\S+)", out).group(1))
        assert tokens.dtype == np.uint16 and 0 < share < 0.5 and len(tokens) > 1000


@pytest.mark.slow  # a simulate, a launch of two learners and an eval: ~2 min on 2 shared cores
def test_the_models_md_commands_run_as_printed(folder):
    found = setup_folder("models.md", folder)
    commands = [b for b in found if b.lang == "bash" and b.mark not in ("not run", "run by")]
    assert commands, "docs/models.md shows no commands"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("WAN_DILOCO_TOKEN", None)  # as a new user has it: launch draws one
    for b in commands:
        done = subprocess.run(["bash", "-e", "-c", b.text], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"{b} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = done.stdout
    assert "result: " in out, out  # simulate says where it wrote its result
    assert (folder / "runs/my-lm/checkpoints/params.safetensors").is_file()
    held_out = json.loads(out.strip().splitlines()[-1])  # eval's line
    assert held_out["eval_loss"] < np.log(256) - 1, held_out  # it learned: well below a uniform guess over bytes
    events = [json.loads(x) for x in (folder / "runs/my-lm/metrics.jsonl").read_text().splitlines()]
    evals = sorted({e["step"] for e in events if e.get("event") == "eval"})
    assert evals and all(s % 20 == 0 for s in evals) and {20, 40} <= set(evals), evals  # run.eval_every_steps
