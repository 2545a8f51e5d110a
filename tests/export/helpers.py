"""A run file that can run across machines, and what the tests of its exports share."""
from __future__ import annotations

from pathlib import Path

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


def parse(parser, argv: list[str]):
    """Our own CLI's reading of a generated command line (SystemExit on anything it refuses)."""
    assert argv[0] == "wan-diloco", argv
    return parser.parse_args(argv[1:])


def credentials(home: Path, learners: int) -> None:
    """Token files as `launch.sh` makes them (their contents name their owner)."""
    (home / "tokens").mkdir(parents=True)
    (home / "token").write_text("run-token-0123\n")
    for m in range(learners):
        (home / "tokens" / f"learner-{m}.token").write_text(f"learner-{m}-token\n")
