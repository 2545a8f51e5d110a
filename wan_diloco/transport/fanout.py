"""Downstream fan-out with bounded memory: the newest version per fragment per subscriber.

Backpressure policy (chosen): drop-to-latest per routing key. Every published
Frame is keyed by its ``fragment`` field, and a newer frame with the same key
replaces one not yet delivered. A slow subscriber then never blocks the
publisher or the other subscribers, and its backlog is at most one pending
frame per key (P encoded frames, shared between subscribers because each is
encoded once). Frames overwritten before delivery are counted in ``dropped``.

The application's updates are deltas, not self-contained fragments: each says
"version v of fragment p is version v-1 plus this". Dropping one therefore
leaves a gap, and the application must detect and heal it: every update names
the version it applies to (``GlobalUpdate.from_version``), a learner that sees
one it does not hold skips it and fetches the whole current fragment by bulk
(``core.protocol.Resync``, ``fragment/P``), and the newest delta it then finds
applies on top. That is what makes dropping safe here; a downstream that cannot
fetch the whole state would need a blocking queue instead.

"Newer" means published later: the hub numbers publications (``Prepared.seq``),
because the transport does not look inside ``meta`` for a version.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from .framing import Prepared
from .messages import Frame


class LatestMailbox:
    """Pending frames of one subscriber, at most one per fragment (the newest published)."""

    def __init__(self) -> None:
        self._pending: dict[int, Prepared] = {}
        self._wakeup = asyncio.Event()
        self.generation = 0  # bumped when a new stream takes over this mailbox
        self.dropped = 0
        self.delivered = 0

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, item: Prepared) -> None:
        key = item.message.fragment
        old = self._pending.get(key)
        if old is not None:
            if old.seq >= item.seq:
                return  # an older frame coming back (interrupted delivery) never replaces a newer one
            self.dropped += 1
            del self._pending[key]  # re-queue at the back: oldest fragment goes first
        self._pending[key] = item
        self._wakeup.set()

    async def get(self, generation: int) -> Prepared | None:
        """The oldest pending frame; None once a newer stream took over (``interrupt``)."""
        while self.generation == generation:
            if self._pending:
                self.delivered += 1
                return self._pending.pop(next(iter(self._pending)))
            self._wakeup.clear()
            await self._wakeup.wait()
        return None

    def interrupt(self) -> int:
        """Start a new generation: the reader of the previous one wakes up and stops."""
        self.generation += 1
        self._wakeup.set()
        return self.generation


class UpdateHub:
    """Encodes each Frame once and queues it for every known subscriber.

    A subscriber's mailbox outlives its stream: frames published while it is
    reconnecting wait for it (newest per fragment). A second subscription with
    the same id ends the first stream (``TransportServer`` lets only the same
    client process do that: another process with the same id is refused).
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._boxes: dict[str, LatestMailbox] = {}
        self._seq = itertools.count(1)

    @property
    def subscribers(self) -> list[str]:
        return sorted(self._boxes)

    def mailbox(self, learner_id: str) -> LatestMailbox:
        return self._boxes.setdefault(learner_id, LatestMailbox())

    def publish(self, frame: Frame, to: list[str] | None = None) -> Prepared:
        """Encode ``frame`` once and queue it for ``to`` (default: every known subscriber).

        Raises MessageError (nothing queued) if the frame cannot be encoded."""
        if not isinstance(frame, Frame):
            raise TypeError(f"publish takes a Frame, got {type(frame).__name__}")
        item = Prepared.of(frame, self.chunk_bytes, next(self._seq))
        for learner_id in self._boxes if to is None else to:
            self.mailbox(learner_id).put(item)
        return item

    def forget(self, learner_id: str) -> None:
        """Drop a learner's mailbox (it left for good); its stream, if any, ends."""
        box = self._boxes.pop(learner_id, None)
        if box is not None:
            box.interrupt()

    def stream(self, learner_id: str) -> AsyncIterator[Prepared]:
        """Frames for ``learner_id`` until another stream takes over its mailbox.

        The mailbox is registered (and any previous stream ended) right away, not
        at the first iteration, so nothing published in between is missed. A
        frame whose delivery is interrupted goes back into the mailbox (unless a
        newer one for its fragment is already there), so a subscriber may see one
        frame twice: the application must ignore what it already applied. A frame
        written whole into a call the client has already left, before the server
        learns the call ended, counts as delivered and is lost to that subscriber:
        the gap heals as any dropped frame does (the next version's Resync). A
        planned renewal loses nothing: the client opens its next call first, and
        this stream ends after the frame it is sending.
        """
        box = self.mailbox(learner_id)
        return self._drain(box, box.interrupt())

    @staticmethod
    async def _drain(box: LatestMailbox, generation: int) -> AsyncIterator[Prepared]:
        while (item := await box.get(generation)) is not None:
            try:
                yield item
            except BaseException:
                box.put(item)
                raise
