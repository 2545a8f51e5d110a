"""A run file that can run across machines, and fakes of `wan-diloco` and `srun` that record how the
generated scripts call them (the scripts themselves run for real, in bash)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from wan_diloco.spec import RunSpec

BASE = {
    "run": {"learners": 5, "steps": 100, "host": "0.0.0.0", "port": 7070, "status_port": 7071, "run_id": "exp-1"},
    "model": {"preset": "micro"},
    "learner": {"num_fragments": 2},
    "regions": {"names": ["us-east-1", "eu-west-1"]},
    "transport": {"tls": {"server_name": "wd-syncer"}},
}


def run_file(**tables: dict) -> tuple[RunSpec, str]:
    """(spec, TOML text) of BASE with some keys of some tables replaced."""
    doc = {k: dict(v) for k, v in BASE.items()}
    for name, changes in tables.items():
        doc[name] = {**doc.get(name, {}), **changes}
    text = tomli_w.dumps(doc)
    return RunSpec.from_dict(doc), text


@pytest.fixture(scope="session")
def parser():
    from wan_diloco.cli import build_parser

    return build_parser()


def parse(parser, argv: list[str]):
    """Our own CLI's reading of a generated command line (SystemExit on anything it refuses)."""
    assert argv[0] == "wan-diloco", argv
    return parser.parse_args(argv[1:])


FAKE = """#!{python}
import json, os, sys
with open(os.environ["CAPTURE"], "a") as f:
    f.write(json.dumps({{"argv": ["wan-diloco"] + sys.argv[1:],
                        "env": {{k: v for k, v in os.environ.items() if k.startswith("WAN_DILOCO_")}}}}) + "\\n")
"""
# srun runs its command once per task, as Slurm would, with that task's SLURM_PROCID
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for ((t = 0; t < FAKE_NTASKS; t++)); do SLURM_PROCID=$t "$@" || exit 1; done
"""


@pytest.fixture
def fakes(tmp_path):
    """run(script, env) -> the [{argv, env}] of every `wan-diloco` the bash script started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("wan-diloco", FAKE.format(python=sys.executable)), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    capture = tmp_path / "capture.jsonl"

    def run(script: str, **env: str) -> list[dict]:
        capture.write_text("")
        path = tmp_path / "script.sh"
        path.write_text(script)
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CAPTURE": str(capture), **env}
        proc = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in capture.read_text().splitlines()]

    return run


def credentials(home: Path, learners: int) -> None:
    """Token files as `launch.sh` makes them (their contents name their owner)."""
    (home / "tokens").mkdir(parents=True)
    (home / "token").write_text("run-token-0123\n")
    for m in range(learners):
        (home / "tokens" / f"learner-{m}.token").write_text(f"learner-{m}-token\n")
