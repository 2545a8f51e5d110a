"""What a learner's network thread (``runtime.netthread``) puts on the training thread's inbox: typed
items, dispatched with one ``match`` on their classes, never on names.

Besides these, the inbox carries the core's own ``Identity``, ``Barrier``, ``Donate`` and ``SnapshotCut`` as they came
off the update stream, and ``transport.LinkSample``s of the link probe (``InboxItem`` lists them all).
``Saved`` and ``Donated`` are the training thread's own: its background writes report back through the
same inbox, so that one loop sees every event in the order it happened.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Union

from wan_diloco.core.messages import Barrier, Donate, GlobalUpdate, Identity, SnapshotCut
from wan_diloco.transport import LinkSample


@dataclasses.dataclass(frozen=True)
class Arrived:
    """A global update off the stream, stamped (``time.monotonic``) when it arrived: the learner merges
    between steps, but its sync time is measured to here."""

    arrived_s: float
    update: GlobalUpdate


@dataclasses.dataclass(frozen=True)
class ChannelsWidened:
    """The measured link needed more connections to the syncer; they are open."""

    channels_old: int
    channels_new: int
    why: str


@dataclasses.dataclass(frozen=True)
class Refused:
    """The syncer refused this learner's settings at its hello (``core.fingerprint``): retrying cannot
    help, the learner stops with ``reason`` (one line naming what differs)."""

    reason: str


@dataclasses.dataclass(frozen=True)
class StreamLost:
    """An update stream ended or failed: the syncer is gone (or restarting); ``reason`` says which."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Saved:
    """The training thread's background write of its part of snapshot ``snapshot`` ended; ``result``
    (done) holds how."""

    snapshot: int
    result: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Donated:
    """The training thread's background upload of its state for learner ``recipient`` ended; ``result``
    (done) holds how."""

    recipient: int
    result: concurrent.futures.Future


InboxItem = Union[Identity, Barrier, Donate, SnapshotCut, Arrived, LinkSample, ChannelsWidened, Refused, StreamLost,
                  Saved, Donated]
