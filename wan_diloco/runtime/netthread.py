"""A learner's network side: an asyncio loop (uvloop when installed) on its own thread.

The training thread hands work over with thread-safe calls and reads results
from ``inbox`` (a ``queue.Queue``) between steps, so it never waits on the
network unless it chooses to. Memory stays bounded: only the newest metadata
is kept, and at most one upload per fragment is pending (a newer snapshot of a
fragment supersedes an older one still waiting to be sent).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any

from wan_diloco.core import ProtocolError
from wan_diloco.runtime import wire
from wan_diloco.transport import (
    BulkRequest, MessageError, SyncerClient, TransportConfig, TransportError, TransportMetrics, new_event_loop,
)

log = logging.getLogger(__name__)


class NetThread:
    def __init__(self, target: str, token: str, config: TransportConfig, node: str, region: str,
                 codec: wire.WireCodec, layout: wire.Layout):
        self.node, self.region, self.codec, self.layout = node, region, codec, layout
        self.inbox: queue.Queue = queue.Queue()  # ("update", (arrived_s, GlobalUpdate)) | ("error", text)
        self.metrics = TransportMetrics()
        self.loop = new_event_loop()
        self.client = SyncerClient(target, token, config, self.metrics)
        self._thread = threading.Thread(target=self._main, name=f"{node}-net", daemon=True)
        self._ready = threading.Event()
        self._md: Any = None
        self._md_task: asyncio.Task | None = None
        self._sub_task: asyncio.Task | None = None
        self._uploads: dict[int, concurrent.futures.Future] = {}
        self.upload_errors = 0
        self.bad_updates = 0

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> "NetThread":
        self._thread.start()
        self._ready.wait()
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.client.connect())
        self._sub_task = self.loop.create_task(self._subscribe())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.client.close())
        self.loop.close()

    def stop(self) -> None:
        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
            self._thread.join(10)

    # ---- downstream -----------------------------------------------------------------

    async def _subscribe(self) -> None:
        try:
            async for msg in self.client.subscribe(self.node, self.region):
                try:
                    # Stamped on arrival: the learner merges between steps, but sync time is measured to here.
                    self.inbox.put(("update", (time.monotonic(), wire.update_from_wire(msg, self.codec))))
                except ProtocolError as e:
                    self.bad_updates += 1
                    log.error("%s: refused a global update: %s", self.node, e)
            self.inbox.put(("error", "the syncer ended the update stream"))
        except (TransportError, MessageError) as e:
            self.inbox.put(("error", f"update stream failed: {e}"))

    # ---- upstream (called from the training thread) ---------------------------------

    def send_metadata(self, msg) -> None:
        """Queue metadata; only the newest unsent one is kept."""
        self.loop.call_soon_threadsafe(self._kick_metadata, msg)

    def _kick_metadata(self, msg) -> None:
        self._md = msg
        if self._md_task is None or self._md_task.done():
            self._md_task = self.loop.create_task(self._send_metadata())

    async def _send_metadata(self) -> None:
        while self._md is not None:
            msg, self._md = self._md, None
            try:
                await self.client.send_metadata(msg)
            except (TransportError, MessageError) as e:
                log.warning("%s: metadata not delivered: %s", self.node, e)

    def upload(self, msg) -> concurrent.futures.Future:
        """Send a fragment; a pending older upload of the same fragment is cancelled."""
        old = self._uploads.get(msg.fragment)
        if old is not None and not old.done():
            old.cancel()
        fut = asyncio.run_coroutine_threadsafe(self._upload(msg), self.loop)
        self._uploads[msg.fragment] = fut
        return fut

    async def _upload(self, msg):
        try:
            return await self.client.upload_fragment(msg)
        except (TransportError, MessageError) as e:
            self.upload_errors += 1
            log.warning("%s: upload of fragment %d failed: %s", self.node, msg.fragment, e)
            raise

    def fetch_fragment(self, name: str) -> concurrent.futures.Future:
        """Bulk-fetch ``fragment/P`` or ``final/P`` -> (fragment, version, global_step, values)."""

        async def fetch():
            data = await self.client.fetch_bulk_bytes(BulkRequest(self.node, name, {}))
            return wire.fragment_from_bulk(data, self.layout)

        return asyncio.run_coroutine_threadsafe(fetch(), self.loop)

    def wait_uploads(self, timeout_s: float) -> None:
        concurrent.futures.wait([f for f in self._uploads.values()], timeout=timeout_s)

    @property
    def bytes_sent(self) -> int:
        return _total(self.metrics.bytes_out)

    @property
    def bytes_received(self) -> int:
        return _total(self.metrics.bytes_in)


def _total(counter) -> int:
    return int(sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")))
