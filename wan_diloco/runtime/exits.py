"""How a learner process ends: the exceptions that stop it and the exit status each maps to.

One table (docs/operations.md, "Exit codes", says the same for a user):

====  =====================================================================================
code  why the learner stopped
====  =====================================================================================
0     the run ended and its final model equals the syncer's (``EXIT_OK``)
1     a bug: a traceback follows (``EXIT_BUG``; what a multi-process leader tells its
      followers when it fails otherwise)
3     the syncer was lost (``SyncerLost``), is not the one this learner's model came from
      (a fork: ``core.IncarnationError``), refused this learner's settings (``SyncerLost``
      with the syncer's line), the start barrier was not met (``StartTimeout``), or the
      transport failed for good (``TransportError``, ``MessageError``) (``EXIT_SYNCER``)
4     the final model differs from the syncer's (``EXIT_DIGEST_MISMATCH``)
5, 6  a multi-process learner's job: ``multihost.EXIT_PEERS_MISSING``, ``EXIT_JOB_BROKEN``
143   a signal stopped it (``Stopped`` while it waited; ``EXIT_STOPPED``)
====  =====================================================================================
"""
from __future__ import annotations

import grpc

from wan_diloco.core import IncarnationError
from wan_diloco.transport import MessageError, TransportError

EXIT_OK = 0
EXIT_BUG = 1
EXIT_SYNCER = 3
EXIT_DIGEST_MISMATCH = 4
EXIT_STOPPED = 143


class SyncerLost(RuntimeError):
    """The syncer stayed unreachable for longer than the transport's retry budget (or refused this learner)."""


class StartTimeout(RuntimeError):
    """The start barrier was not met within run.start_timeout_s; the text names who never joined."""


class Stopped(Exception):
    """A signal asked the learner to stop while it waited on the network."""


# Not a bug: the learner says why in one line and ends with EXIT_SYNCER.
STOPS = (IncarnationError, SyncerLost, StartTimeout, TransportError, MessageError)


def stop_line(e: BaseException, learner: int, target: str) -> str:
    """The one line a learner stopped by one of ``STOPS`` ends with."""
    if isinstance(e, TransportError) and e.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (f"the syncer at {target} refused this learner's token ({e.code.name}): {e.details}; "
                f"$WAN_DILOCO_TOKEN must be the run's token or this learner's own (`wan-diloco token --learner "
                f"{learner}` on the syncer's host), and with mutual TLS the certificate must be learner-{learner}'s")
    return str(e)


def exit_code(result: dict) -> int:
    """The status of a learner whose ``run`` returned ``result`` (its ``final`` or ``stopped`` event)."""
    if result.get("digest_mismatch"):
        return EXIT_DIGEST_MISMATCH
    return EXIT_OK if result["event"] == "final" else EXIT_STOPPED
