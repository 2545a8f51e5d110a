"""Vector clocks: each worker's own step and the latest step it knows of every other worker.

Attached to every message; they order events across workers (happened-before),
detect concurrency, and give consistent-snapshot and garbage-collection watermarks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

Order = Literal["before", "after", "equal", "concurrent"]


@dataclass(frozen=True)
class VectorClock:
    """Immutable vector clock; missing entries count as 0."""

    entries: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node, value in self.entries.items():
            if not isinstance(node, str) or not node:
                raise ValueError(f"vector clock: node name must be a non-empty string, got {node!r}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"vector clock: entry {node!r} must be a non-negative integer, got {value!r}")
        # Drop zeros so equal clocks compare equal whatever was written out.
        object.__setattr__(self, "entries", {k: v for k, v in sorted(self.entries.items()) if v})

    def __getitem__(self, node: str) -> int:
        return self.entries.get(node, 0)

    def tick(self, node: str) -> "VectorClock":
        """This node did something: advance its own entry."""
        return VectorClock({**self.entries, node: self[node] + 1})

    def merge(self, other: "VectorClock") -> "VectorClock":
        """Entry-wise maximum: what a receiver knows after reading ``other``."""
        nodes = set(self.entries) | set(other.entries)
        return VectorClock({n: max(self[n], other[n]) for n in nodes})

    def receive(self, node: str, other: "VectorClock") -> "VectorClock":
        """``node`` received a message stamped ``other``: merge, then tick."""
        return self.merge(other).tick(node)

    def __le__(self, other: "VectorClock") -> bool:
        return all(v <= other[n] for n, v in self.entries.items())

    def compare(self, other: "VectorClock") -> Order:
        le, ge = self <= other, other <= self
        if le and ge:
            return "equal"
        if le:
            return "before"
        if ge:
            return "after"
        return "concurrent"

    def happened_before(self, other: "VectorClock") -> bool:
        return self.compare(other) == "before"

    def concurrent(self, other: "VectorClock") -> bool:
        return self.compare(other) == "concurrent"

    def to_dict(self) -> dict[str, int]:
        return dict(self.entries)

    @classmethod
    def from_dict(cls, data: object) -> "VectorClock":
        if not isinstance(data, Mapping):
            raise ValueError(f"vector clock: expected a mapping, got {type(data).__name__}")
        return cls(dict(data))
