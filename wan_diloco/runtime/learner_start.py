"""Before a networked learner's first step: reaching the syncer, and the start barrier (``core.barrier``).

Methods of ``runtime.learner.Learner`` kept in a module of their own (``self`` is the learner).
"""
from __future__ import annotations

import sys
import time

from wan_diloco.runtime.events import emit
from wan_diloco.runtime.exits import StartTimeout, Stopped, SyncerLost
from wan_diloco.transport.reach import Diagnosis, diagnose


def unreachable(target: str, t) -> Diagnosis | None:
    """Why the syncer (or which of its shards, in a comma-separated ``target``) cannot be reached, or None."""
    for one in target.split(","):
        why = diagnose(one, t.tls, timeout_s=min(5.0, t.call_timeout_s))
        if why is not None:
            if "," in target:
                lasting, why = why.lasting, Diagnosis(f"{one}: {why}")
                why.lasting = lasting
            return why
    return None


def reach_syncer(self) -> None:
    """Before the first call: if the syncer (or one of its shards) cannot be reached, say why at once
    (one line naming the address and the cause), then try again with backoff for
    ``transport.retry_budget_s``; SyncerLost after that. gRPC alone would wait out a call deadline
    and say DEADLINE_EXCEEDED."""
    t = self.cfg.transport
    deadline, wait_s, said = time.monotonic() + t.retry_budget_s, t.backoff_initial_s, None
    while (why := unreachable(self.target, t)) is not None:
        if getattr(why, "lasting", False):  # TLS on one side only, a certificate not trusted: waiting won't help
            raise SyncerLost(f"cannot reach the syncer at {self.target}: {why}; not retried: the two sides' "
                             "[transport.tls] disagree, which does not heal by waiting")
        left = deadline - time.monotonic()
        if left <= 0:
            raise SyncerLost(f"cannot reach the syncer at {self.target}: {why}; gave up after "
                             f"{t.retry_budget_s:g} s (transport.retry_budget_s)")
        if why != said:  # each new reason once, not a line per retry
            said = why
            print(f"learner-{self.m}: cannot reach the syncer at {self.target}: {why}; retrying for up to "
                  f"{left:.0f} s", file=sys.stderr, flush=True)
            emit({"event": "warning", "role": "learner", "learner": self.m,
                  "what": f"cannot reach the syncer at {self.target}: {why}"})
        if self.stop.wait(min(wait_s, max(left, 0.0))):
            raise Stopped()
        wait_s = min(2 * wait_s, t.backoff_max_s)

def await_start(self) -> None:
    """The start barrier: take no step before the syncer says enough learners joined (at once for a
    learner that joins a run already started). Metadata every few seconds keeps it alive meanwhile."""
    said, last_md_s = None, time.monotonic()
    every_s = min(5.0, self.cfg.syncer.liveness_timeout_s / 3)
    while not self.stop.is_set():
        self.drain(block_s=0.1)
        now = time.monotonic()
        if not self.barrier.must_wait(now):
            if said is not None:
                emit({"event": "barrier", "role": "learner", "learner": self.m, "started": True,
                      "need": self.barrier.need, "joined": list(self.barrier.joined), "waiting_for": []})
            return
        if self.barrier.expired(now):
            raise StartTimeout(self.barrier.failure())
        seen = (self.barrier.joined, self.barrier.waiting_for)
        if seen != said and self.barrier.need and self.m not in seen[1]:  # (not before its own join counted)
            said = seen
            emit({"event": "barrier", "role": "learner", "learner": self.m, "started": False,
                  "need": self.barrier.need, "joined": list(seen[0]), "waiting_for": list(seen[1])})
        if now - last_md_s >= every_s:
            last_md_s = now
            self.send_metadata(self.core.metadata())
    raise Stopped()
