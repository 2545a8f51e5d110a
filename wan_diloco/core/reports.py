"""The one action every learner-side core piece may return besides its own: something worth a line in
the run's log."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Report:
    """Driver: write ``event`` to the run's event log as it is (the network driver's ``events.emit``;
    the simulator may keep or drop it). It changes no state."""

    event: dict[str, Any]


def warning(learner: int, what: str) -> Report:
    return Report({"event": "warning", "role": "learner", "learner": learner, "what": what})
