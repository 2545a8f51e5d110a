"""What a chaos run did, as plain data (written next to the run as ``chaos_record.json``)."""
from __future__ import annotations

import dataclasses
import json
from typing import Callable



@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a chaos run did, as plain JSON-able data: ``events`` are every process's JSON lines with
    ``source`` (wall-clock ``t`` and ``pid`` from the process); ``procs`` one entry per process
    started (name, pid, spawn_t, exit_t, exit_code, killed); ``faults`` each fault as it fired
    (``fired_t``, ``undone_t``, ``skipped``: why it was not applied). Times are wall-clock seconds;
    ``t0`` is when every learner had logged ``start`` (imported, compiled, joined: training began), the
    zero of fault times."""

    t0: float
    t_end: float
    learners: int
    steps: int
    events: list
    procs: list
    faults: list
    error: str | None = None
    run_dir: str = ""
    tokens_per_step: int = 0  # one learner step: batch_size x seq_len predicted positions

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        return cls(**json.loads(text))

    def events_of(self, source: str | None = None, kind: str | None = None) -> list[dict]:
        """Events of one process name (``source``) and/or of one kind, in the order they were read."""
        return [e for e in self.events if (source is None or e["source"] == source)
                and (kind is None or e.get("event") == kind)]

    def first(self, pred: Callable[[dict], bool]) -> dict | None:
        return next((e for e in self.events if pred(e)), None)

    def generations(self, name: str) -> list[dict]:
        """Every process started under ``name`` (a restart is a new generation), oldest first."""
        return [p for p in self.procs if p["name"] == name]

