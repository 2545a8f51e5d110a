"""Downstream fan-out with bounded memory: the newest version per fragment per subscriber.

Backpressure policy (chosen): drop-to-latest per fragment. A GlobalUpdate carries
the whole new global fragment, so only the newest version of each fragment
matters to a learner; a slow subscriber therefore never blocks the syncer or the
other subscribers, and its backlog is at most one pending update per fragment
(P encoded updates, shared between subscribers because each update is encoded
once). Updates overwritten before delivery are counted in ``dropped``.
This is only valid while updates are self-contained; a delta-coded downstream
would need a blocking queue instead.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .framing import Prepared
from .messages import GlobalUpdate


class LatestMailbox:
    """Pending updates of one subscriber, at most one per fragment (the newest)."""

    def __init__(self) -> None:
        self._pending: dict[int, Prepared] = {}
        self._wakeup = asyncio.Event()
        self.generation = 0  # bumped when a new stream takes over this mailbox
        self.dropped = 0
        self.delivered = 0

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, item: Prepared) -> None:
        msg = item.message
        old = self._pending.get(msg.fragment)
        if old is not None:
            if old.message.version >= msg.version:
                return  # an older version arriving late never replaces a newer one
            self.dropped += 1
            del self._pending[msg.fragment]  # re-queue at the back: oldest fragment goes first
        self._pending[msg.fragment] = item
        self._wakeup.set()

    async def get(self, generation: int) -> Prepared | None:
        """The oldest pending update; None once a newer stream took over (``interrupt``)."""
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
    """Encodes each GlobalUpdate once and queues it for every known subscriber.

    A learner's mailbox outlives its stream: updates published while it is
    reconnecting wait for it (newest per fragment). A second subscription with
    the same id ends the first stream.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._boxes: dict[str, LatestMailbox] = {}

    @property
    def subscribers(self) -> list[str]:
        return sorted(self._boxes)

    def mailbox(self, learner_id: str) -> LatestMailbox:
        return self._boxes.setdefault(learner_id, LatestMailbox())

    def publish(self, update: GlobalUpdate, to: list[str] | None = None) -> Prepared:
        """Queue ``update`` for ``to`` (default: every known subscriber)."""
        item = Prepared.of(update, self.chunk_bytes)
        for learner_id in self._boxes if to is None else to:
            self.mailbox(learner_id).put(item)
        return item

    def forget(self, learner_id: str) -> None:
        """Drop a learner's mailbox (it left for good); its stream, if any, ends."""
        box = self._boxes.pop(learner_id, None)
        if box is not None:
            box.interrupt()

    def stream(self, learner_id: str) -> AsyncIterator[Prepared]:
        """Updates for ``learner_id`` until another stream takes over its mailbox.

        The mailbox is registered (and any previous stream ended) right away, not
        at the first iteration, so nothing published in between is missed. An
        update whose delivery is interrupted goes back into the mailbox (unless a
        newer version is already there), so a learner may see one version twice:
        learners ignore updates that are not newer than what they applied.
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
