"""No code that runs what it reads (#13): an AST scan of every module of wan_diloco/ and bench/.

Refused: importing pickle, cPickle, dill, shelve, marshal or joblib (deserializing them runs code);
eval, exec, the builtin compile, __import__ of a computed name (or of one of those modules, also via
importlib); os.system, os.popen, subprocess with
shell=True; yaml.load without a SafeLoader; numpy.load with allow_pickle; torch.load. Names are
resolved through ``import x as y`` and ``from x import y``, so ``np.load`` is numpy.load and
``re.compile`` is not the builtin. The scanner itself is tested on snippets below, both ways.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("wan_diloco", "bench")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "joblib", "cloudpickle"}
BUILTINS = {"eval", "exec", "compile"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"}


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``np.load`` -> "numpy.load" through the module's imports; None if not a plain dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _not_false(value: ast.expr | None) -> bool:
    """A keyword that is present and not the literal False (a variable might be True)."""
    return value is not None and not (isinstance(value, ast.Constant) and value.value in (False, None, 0))


def _banned(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in BANNED_MODULES


def scan(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line: what`` for every refused construct in ``source``."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    # Imports first (anywhere in the module: they bind names for the whole scope we care about).
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _banned(a.name):
                    hit(node, f"import {a.name}")
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and _banned(module):
                hit(node, f"from {module} import ...")
            for a in node.names:
                if node.level == 0 and _banned(f"{module}.{a.name}" if module else a.name) and not _banned(module):
                    hit(node, f"from {module} import {a.name}")
                aliases[a.asname or a.name] = f"{module}.{a.name}" if node.level == 0 else f".{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name is None:
            continue
        first = node.args[0] if node.args else None
        literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
        if name in BUILTINS or name in {f"builtins.{b}" for b in BUILTINS}:
            hit(node, f"call of {name.rpartition('.')[2]}()")
        elif name in ("__import__", "builtins.__import__"):
            if not literal:
                hit(node, f"{name}() of a computed name")
            elif _banned(first.value):
                hit(node, f"{name}({first.value!r})")
        elif name == "importlib.import_module" and literal and _banned(first.value):
            # A computed name is allowed here: the CLI picks its subcommand modules from a fixed table.
            hit(node, f"{name}({first.value!r})")
        elif name in ("os.system", "os.popen"):
            hit(node, f"{name}()")
        elif name.startswith("subprocess.") and _not_false(_kw(node, "shell")):
            hit(node, f"{name}(shell=True)")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader, aliases) not in SAFE_YAML_LOADERS:
                hit(node, f"{name}() without a SafeLoader")
        elif name in ("yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all"):
            hit(node, f"{name}()")
        elif name == "numpy.load" and _not_false(_kw(node, "allow_pickle")):
            hit(node, "numpy.load(allow_pickle=True)")
        elif name == "torch.load":
            hit(node, "torch.load()")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def _modules() -> list[Path]:
    return sorted(p for d in SCANNED if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


def test_no_module_deserializes_or_runs_code_it_reads():
    files = _modules()
    assert len(files) > 30 and any(p.name == "messages.py" for p in files), [str(p) for p in files[:5]]
    found = [f for p in files for f in scan(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not found, "unsafe calls:\n" + "\n".join(found)


# ---- the scanner finds what it should, and only that -------------------------------------------

@pytest.mark.parametrize("source, what", [
    ("import pickle", "import pickle"),
    ("import pickle as p", "import pickle"),
    ("import dill.settings", "import dill.settings"),
    ("from shelve import open", "from shelve import"),
    ("import marshal, json", "import marshal"),
    ("from joblib import load", "from joblib import"),
    ("import cPickle", "import cPickle"),
    ("eval('1')", "call of eval()"),
    ("exec(code)", "call of exec()"),
    ("compile(src, 'f', 'exec')", "call of compile()"),
    ("import builtins\nbuiltins.eval(x)", "call of eval()"),
    ("__import__(name)", "__import__() of a computed name"),
    ("__import__('pickle')", "__import__('pickle')"),
    ("import importlib\nimportlib.import_module('pickle')", "importlib.import_module('pickle')"),
    ("import os\nos.system('ls')", "os.system()"),
    ("from os import popen\npopen('ls')", "os.popen()"),
    ("import subprocess\nsubprocess.run('ls', shell=True)", "subprocess.run(shell=True)"),
    ("import subprocess as sp\nsp.Popen(cmd, shell=flag)", "subprocess.Popen(shell=True)"),
    ("from subprocess import check_output\ncheck_output('ls', shell=True)", "subprocess.check_output(shell=True)"),
    ("import yaml\nyaml.load(f)", "yaml.load() without a SafeLoader"),
    ("import yaml\nyaml.load(f, Loader=yaml.FullLoader)", "yaml.load() without a SafeLoader"),
    ("import yaml\nyaml.unsafe_load(f)", "yaml.unsafe_load()"),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", "numpy.load(allow_pickle=True)"),
    ("from numpy import load\nload(f, allow_pickle=1)", "numpy.load(allow_pickle=True)"),
    ("import torch\ntorch.load(f)", "torch.load()"),
    ("def f():\n    import torch as t\n    return t.load(p, weights_only=True)", "torch.load()"),
])
def test_scanner_flags(source, what):
    found = scan(source, "x.py")
    assert any(what in f for f in found), found
    assert all(f.startswith("x.py:") and f.split(":")[1].isdigit() for f in found), found


@pytest.mark.parametrize("source", [
    "import json\njson.loads(s)",
    "import re\nre.compile('x')",
    "from re import compile\ncompile('x')",
    "import numpy as np\nnp.load(f)",
    "import numpy as np\nnp.load(f, allow_pickle=False)",
    "import subprocess\nsubprocess.run(['ls'])",
    "import subprocess\nsubprocess.run(['ls'], shell=False)",
    "import yaml\nyaml.safe_load(f)",
    "import yaml\nyaml.load(f, Loader=yaml.SafeLoader)",
    "import importlib\nimportlib.import_module('wan_diloco.cli.train')",
    "__import__('json')",
    "model.eval()",
    "x.exec(q)",
    "import safetensors.numpy\nsafetensors.numpy.load_file(p)",
    "import os\nos.execvp('ip', argv)",
])
def test_scanner_lets_safe_code_through(source):
    assert scan(source) == []
