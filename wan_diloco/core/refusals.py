"""Refused messages, counted by field and by learner (docs/operations.md, "Refusals and quarantine").

Every refusal is counted; it is logged (as a core notice) at most ``LOG_BURST`` times per learner in
``LOG_WINDOW_S``, and the next line says how many were left out, so a flood cannot fill the log. A
learner refused ``max_refusals`` times within ``window_s`` is due for quarantine. Sans-IO.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

LOG_BURST = 5  # refusal lines per learner per window ...
LOG_WINDOW_S = 10.0  # ... this long
QUARANTINED = "quarantined"  # the field of a message refused because its sender is in quarantine


@dataclass
class _LogWindow:
    start_s: float
    logged: int = 0
    left_out: int = 0
    fields: Counter = field(default_factory=Counter)


class Refusals:
    def __init__(self, max_refusals: int, window_s: float):
        self.max_refusals, self.window_s = max_refusals, window_s
        self.by_field: Counter[str] = Counter()
        self.by_learner: Counter[int] = Counter()
        self._recent: dict[int, deque[float]] = {}
        self._log: dict[int | None, _LogWindow] = {}

    def record(self, now_s: float, learner: int | None, what: str, why: str) -> tuple[str | None, bool]:
        """Count one refusal of field ``what`` from ``learner`` (None: not attributable).

        Returns (the line to log or None when rate-limited, whether ``learner`` is now due for
        quarantine). Refusals of a quarantined learner's messages count, but toward nothing more."""
        what = what or "other"
        self.by_field[what] += 1
        due = False
        if learner is not None:
            self.by_learner[learner] += 1
            if what != QUARANTINED:
                recent = self._recent.setdefault(learner, deque())
                recent.append(now_s)
                while recent and recent[0] <= now_s - self.window_s:
                    recent.popleft()
                due = len(recent) >= self.max_refusals
                if due:
                    recent.clear()
        return self._line(now_s, learner, what, why), due

    def _line(self, now_s: float, learner: int | None, what: str, why: str) -> str | None:
        win = self._log.get(learner)
        if win is None or now_s - win.start_s >= LOG_WINDOW_S:
            left = win.left_out if win is not None else 0
            fields = dict(win.fields) if win is not None else {}
            win = self._log[learner] = _LogWindow(now_s)
        else:
            left, fields = 0, {}
        if win.logged >= LOG_BURST:
            win.left_out += 1
            win.fields[what] += 1
            return None
        win.logged += 1
        who = f"learner {learner}" if learner is not None else "an unknown sender"
        more = f" ({left} more refusals of {who} not logged before this one: {fields})" if left else ""
        return f"refused a message of {who} [{what}]: {why}{more}"
