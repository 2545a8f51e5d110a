"""The canonical micro run (examples/micro.toml) that every test and benchmark needing a small run starts from,
changing only what it is about. Tests import it from tests/conftest.py; benchmarks from here (no side effects:
the conftest also pins JAX to the CPU).
"""
import copy
import tomllib
from pathlib import Path
from typing import Any

# The one small run every test and benchmark starts from; each changes only what it is about.
MICRO_TOML = Path(__file__).resolve().parents[1] / "examples" / "micro.toml"
TOKEN = "runtime-test-token-0123"


def merge(doc: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``doc`` in place, table by table and key by key; a None value deletes the key."""
    for key, value in over.items():
        if value is None:
            doc.pop(key, None)
        elif isinstance(value, dict) and isinstance(doc.get(key), dict):
            merge(doc[key], value)
        else:
            doc[key] = copy.deepcopy(value)
    return doc


def micro_document(extra: str = "", **tables: dict[str, Any] | None) -> dict[str, Any]:
    """examples/micro.toml as a TOML document, with ``tables`` (``run={"learners": 2}``) and the TOML text
    ``extra`` merged over it."""
    doc = tomllib.loads(MICRO_TOML.read_text())
    return merge(merge(doc, tables), tomllib.loads(extra))


def micro_spec(extra: str = "", **tables: dict[str, Any] | None):
    """The canonical micro run as a validated ``RunSpec`` (see :func:`micro_document`)."""
    from wan_diloco import spec
    return spec.from_document(micro_document(extra, **tables))


def micro_model(**fields: Any):
    """The canonical micro model (``model.preset("micro")``) with ``fields`` changed (``seq_len=16``)."""
    import dataclasses

    from wan_diloco import model
    return dataclasses.replace(model.preset("micro"), **fields)


def micro_toml(extra: str = "", **tables: dict[str, Any] | None) -> str:
    """The canonical micro run with the given changes (see :func:`micro_document`) as TOML text."""
    import tomli_w
    return tomli_w.dumps(micro_document(extra, **tables))


def write_micro(path: Path, extra: str = "", **tables: dict[str, Any] | None) -> Path:
    """The canonical micro run with the given changes written to ``path`` as TOML."""
    path.write_text(micro_toml(extra, **tables))
    return path


def micro_config(tmp_path: Path, learners: int | None = None, steps: int | None = None,
                 min_step_s: float | None = None, token: str = TOKEN, extra: str = "", tau: int | None = None,
                 **tables: dict[str, Any] | None) -> Path:
    """tmp_path/micro.toml: the canonical micro run for real processes (a bearer token set), with the named
    settings, ``tables`` and the TOML text ``extra`` changed; None keeps the canonical value."""
    run = {k: v for k, v in (("learners", learners), ("steps", steps), ("min_step_s", min_step_s)) if v is not None}
    over = merge({"run": {**run, "token": token}, "learner": {} if tau is None else {"tau": tau}}, tables)
    return write_micro(tmp_path / "micro.toml", extra, **over)
