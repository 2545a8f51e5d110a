"""``[checkpoint]``: where snapshots and the final parameters go, and how often."""
from __future__ import annotations

from dataclasses import dataclass

from wan_diloco.config import require


@dataclass(frozen=True)
class CheckpointConfig:
    # Snapshots (one folder each) and the final parameters. Empty: nothing is written (a standalone
    # syncer warns); `wan-diloco launch` then uses RUN_DIR/checkpoints, and takes a relative path
    # relative to the run folder.
    dir: str = ""
    every_merges: int = 64  # a consistent snapshot every C fragment merges of the syncer; 0: only on demand
    keep: int = 3  # complete snapshots kept; older ones are deleted once a newer one is complete
    # A failed write of the final parameters (a full or read-only disk) is tried again with backoff for
    # this long (an operator who frees space meanwhile saves the run), then the syncer exits non-zero.
    final_write_retry_s: float = 60.0

    def validate(self) -> None:
        require(self.every_merges >= 0, "every_merges", f"must be >= 0 (0: only on demand), got {self.every_merges}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")
        require(0 <= self.final_write_retry_s <= 86400, "final_write_retry_s",
                f"must be in 0..86400 seconds (0: one try), got {self.final_write_retry_s}")
