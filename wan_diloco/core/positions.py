"""Sans-IO ledger of the learners' data positions (docs/operations.md, "Snapshots and resume").

Each learner reports where it is in its data shard (``Metadata.data``, an opaque
string of at most ``max_chars``) with its metadata. The syncer keeps the latest
one per learner, writes them into each snapshot's syncer part, and hands a
learner its own back (``position/M``) when its own snapshot part turns out
unusable at a resume, so it does not read its shard again from the start.
"""
from __future__ import annotations

from typing import Any

MAX_POSITION_CHARS = 256  # as every string field of a message (runtime.serde.MAX_STR_CHARS)


class Positions:
    """learner -> its data position as of its latest metadata."""

    def __init__(self, learners: int, max_chars: int = MAX_POSITION_CHARS):
        self.learners, self.max_chars = learners, max_chars
        self.by_learner: dict[int, str] = {}

    def on_metadata(self, now_s: float, learner: int, data: str) -> list:
        """A learner's metadata with its position (empty: it did not say; the last one stands)."""
        if data and 0 <= learner < self.learners and len(data) <= self.max_chars:
            self.by_learner[learner] = data
        return []

    def of(self, learner: int) -> str:
        """What ``position/M`` serves: the latest position of ``learner``, "" when none is known."""
        return self.by_learner.get(learner, "")

    def export(self) -> dict[str, str]:
        """For a snapshot's info (JSON: string keys)."""
        return {str(m): pos for m, pos in self.by_learner.items()}

    def restore(self, saved: Any) -> None:
        """Take the positions of a snapshot's info; entries that are not a learner of this run with a
        position within the limits are left out (a snapshot of another run size, or a damaged one)."""
        if not isinstance(saved, dict):
            return
        self.by_learner = {int(m): pos for m, pos in saved.items()
                           if isinstance(m, str) and m.isascii() and m.isdigit() and int(m) < self.learners
                           and isinstance(pos, str) and len(pos) <= self.max_chars}
