"""A learner's network side: an asyncio loop (uvloop when installed) on its own thread.

The training thread hands core messages over with thread-safe calls and reads
results from ``inbox`` (a ``queue.Queue``) between steps, so it never waits on
the network unless it chooses to. Messages become transport frames here
(``serde``), and arriving frames become core messages here, so the training
thread only ever sees the core's types. Memory stays bounded: only the newest
metadata is kept, and at most one upload per fragment is pending (a newer
snapshot of a fragment supersedes an older one still waiting to be sent).

The inbox is typed: each item is one of ``runtime.inbox.InboxItem`` (the core's ``Identity``,
``Barrier``, ``Donate``, ``SnapshotCut``; ``Arrived`` around a core ``GlobalUpdate``;
``transport.LinkSample``; ``ChannelsWidened``; ``Refused``; ``StreamLost``),
and the training thread dispatches them with one ``match`` on their classes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

from wan_diloco.compression import FragmentCodec
from wan_diloco import shards
from wan_diloco.core import FragmentUpload, Metadata, ProtocolError
from wan_diloco.core.fingerprint import SETTINGS_DIFFER
from wan_diloco.core.messages import MAX_LEARNERS, Identity, ObjectRequest, SnapshotCut
from wan_diloco.runtime.inbox import Arrived, ChannelsWidened, InboxItem, Refused, StreamLost  # noqa: F401
from wan_diloco.runtime import serde
from wan_diloco.runtime.shard_view import ShardView
from wan_diloco.transport import (
    BulkRequest, Frame, MessageError, ProbePolicy, SyncerClient, TransportConfig, TransportError,
    TransportMetrics, channels_for_link, host_socket_buffer_bytes, new_event_loop,
)

log = logging.getLogger(__name__)
REFETCH_WAIT_S = 10.0  # the loop thread answers at once; only a stopped one would not


class NetThread:
    """The network thread of learner ``node``: uploads, metadata, the update stream, bulk fetches.

    ``codec`` decodes the syncer's updates (the run's codec); ``bulk_codec`` the
    whole fragments of rejoin, resync and the final fetch (lossless fp32,
    ``Assembly.bulk_codec``).

    ``target`` "HOST:PORT,HOST:PORT,..." names S syncer shards in shard order: each
    fragment goes to, and comes from, its shard (``shards.owners``); metadata goes
    to every shard; peer recovery and the link probe go to shard 0; ``ShardView``
    makes the S shards look like one syncer to the training thread.
    """

    def __init__(self, target: str, token: str, transport_cfg: TransportConfig, node: str, region: str,
                 codec: FragmentCodec, bulk_codec: FragmentCodec, inbox_bytes: int = 256 << 20):
        self.node, self.region, self.codec, self.bulk_codec = node, region, codec, bulk_codec
        # Updates received and not yet taken (``take``) are bounded by ``inbox_bytes`` of payload: past it
        # the stream is not read, HTTP/2 flow control holds the syncer back, and its mailbox keeps only
        # the newest update of each fragment (a version skipped that way is fetched whole).
        self.inbox_bytes = inbox_bytes
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        # ``InboxItem``s; the training thread may put items of its own (its background writes' results).
        self.inbox: queue.Queue = queue.Queue()
        self.metrics = TransportMetrics()
        self.loop = new_event_loop()
        targets = [t.strip() for t in target.split(",")]
        self.clients = [SyncerClient(t, token, transport_cfg, self.metrics) for t in targets]
        self.client = self.clients[0]  # shard 0: peer recovery, positions, the link probe
        self.view = ShardView(shards.owners(codec.layout.nbytes, len(targets))) if len(targets) > 1 else None
        self.probe_policy = ProbePolicy(transport_cfg.probe_seconds, transport_cfg.probe_duty,
                                        transport_cfg.probe_every_s)
        self.auto_channels = transport_cfg.auto_channels
        self.socket_buffer_bytes = host_socket_buffer_bytes()
        self._thread = threading.Thread(target=self._main, name=f"{node}-net", daemon=True)
        self._ready = threading.Event()
        self._md: dict[int, Frame] = {}  # per shard: the newest metadata not sent yet
        # Set once a metadata (the learner's hello) was answered: taken, or refused for its settings.
        self.hello_answered = threading.Event()
        self._md_tasks: dict[int, asyncio.Task] = {}
        self._sub_tasks: list[asyncio.Task] = []
        self._uploads: dict[int, concurrent.futures.Future] = {}
        self.upload_errors = 0
        self.bad_updates = 0
        # When the syncer last answered, and the last call that failed since (see ``silent_s``).
        self.last_contact_s = time.monotonic()
        self.last_failure: tuple[float, str] | None = None

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> "NetThread":
        """Start the thread, open the channels and the update stream; returns self."""
        self._thread.start()
        self._ready.wait()
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        for c in self.clients:
            self.loop.run_until_complete(c.connect())
        self._sub_tasks = [self.loop.create_task(self._subscribe(s)) for s in range(len(self.clients))]
        self._ready.set()
        self.loop.run_forever()
        for c in self.clients:
            self.loop.run_until_complete(c.close())
        self.loop.close()

    def stop(self) -> None:
        """Cancel everything in flight, close the channels and join the thread."""
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

    async def _subscribe(self, shard: int = 0) -> None:
        try:
            async for frame in self.clients[shard].subscribe(self.node, self.region):
                # Stamped on arrival: the learner merges between steps, but sync time is measured to here.
                arrived_s = time.monotonic()
                self.contact()
                try:
                    control = serde.control_from_frame(frame)
                    if self.view is not None and isinstance(control, Identity):
                        E, resumed = self.view.seen(shard, control.epoch, control.resumed_from)
                        control = dataclasses.replace(control, epoch=E, resumed_from=resumed,
                                                      process=self.view.process_ids(shard, control.process))
                    elif self.view is not None and isinstance(control, SnapshotCut):
                        control = self.view.cut(shard, control)
                    if control is not None:  # Identity, Barrier, Donate or SnapshotCut, as the core's types
                        self.inbox.put(control)
                        continue
                    # Off the loop: decoding a large fragment must not stall uploads in flight.
                    update = await asyncio.to_thread(serde.update_from_frame, frame, self.codec)
                    if self.view is not None:
                        update = self.view.update(shard, update)
                except ProtocolError as e:
                    self.bad_updates += 1
                    log.error("%s: refused a global update: %s", self.node, e)
                    continue
                while self.queued_bytes() and self.queued_bytes() + update.nbytes > self.inbox_bytes:
                    await asyncio.sleep(0.005)
                with self._queued_lock:
                    self._queued_bytes += update.nbytes
                self.inbox.put(Arrived(arrived_s, update))
            self.inbox.put(StreamLost(f"{self._name(shard)} ended the update stream"))
        except (TransportError, MessageError) as e:
            self.inbox.put(StreamLost(f"update stream of {self._name(shard)} failed: {e}"))

    def _name(self, shard: int) -> str:
        return "the syncer" if self.view is None else f"syncer shard {shard}"

    def queued_bytes(self) -> int:
        """Payload bytes of the updates in the inbox."""
        return self._queued_bytes

    def next(self, block_s: float = 0.0) -> InboxItem:
        """The next inbox item (waiting up to ``block_s``; queue.Empty if none), making room for updates."""
        item = self.inbox.get(timeout=block_s) if block_s else self.inbox.get_nowait()
        if isinstance(item, Arrived):
            with self._queued_lock:
                self._queued_bytes -= item.update.nbytes
        return item

    def start_probing(self) -> None:
        """Start measuring the link (after the join: a probe must not delay it)."""
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._probe_link()))

    async def _probe_link(self) -> None:
        """Measure the link at start (probing again, bigger, until the samples are long enough and no
        longer rising: ``ProbePolicy.take``), then periodically at the policy's duty cycle; every
        sample that counts goes to the inbox."""
        pol, report = self.probe_policy, {}
        while True:
            nbytes, max_s = pol.request()
            try:
                sample = await self.client.probe(self.node, nbytes, report, max_s=max_s)
            except (TransportError, MessageError) as e:
                log.warning("%s: link probe failed: %s", self.node, e)
                await asyncio.sleep(max(1.0, pol.every_s))
                continue
            if sample.nbytes == 0:  # nothing arrived before the cut-off: no rate to report; try again later
                log.warning("%s: link probe got no bytes in %.1f s", self.node, max_s)
                await asyncio.sleep(max(1.0, pol.every_s))
                continue
            report = sample.to_event()
            if not pol.take(sample):
                continue
            self.inbox.put(sample)
            if await self._widen_for(sample):
                continue  # measure again at once, over the new connections
            if pol.every_s == 0:
                return
            await asyncio.sleep(pol.delay_s())

    async def _widen_for(self, sample) -> bool:
        """Open the connections the measured link needs (``transport.channels_for_link``); True if any."""
        if not self.auto_channels:
            return False
        before = self.client.channels
        want = channels_for_link(sample.rate_gbit_s, sample.rtt_s, self.socket_buffer_bytes, before)
        if want <= before:
            return False
        await self.client.widen(want)
        self.probe_policy.restart()
        self.inbox.put(ChannelsWidened(
            before, self.client.channels,
            f"{sample.rate_gbit_s:.3g} Gbit/s x {sample.rtt_s * 1e3:.0f} ms over {before} connections of "
            f"at most {self.socket_buffer_bytes / 2**20:.0f} MiB each"))
        return self.client.channels > before

    # ---- liveness of the syncer --------------------------------------------------------

    def contact(self) -> None:
        self.last_contact_s, self.last_failure = time.monotonic(), None

    def failed(self, error: Exception) -> None:
        self.last_failure = (time.monotonic(), str(error))

    def silent_s(self) -> tuple[float, str] | None:
        """(seconds since the syncer last answered, the last error) while calls fail; None while it
        answers or nothing was tried (a learner with long steps is not silent, only quiet)."""
        if self.last_failure is None:
            return None
        return time.monotonic() - self.last_contact_s, self.last_failure[1]

    # ---- upstream (called from the training thread; ``upload`` also from its sync worker) ----

    def send_metadata(self, msg: Metadata) -> None:
        """Queue a core Metadata; only the newest unsent one is kept.

        ProtocolError (raised here, nothing queued) if a field is out of range."""
        for s in range(len(self.clients)):
            frame = serde.to_frame(msg if self.view is None else
                                   dataclasses.replace(msg, epoch=self.view.outgoing(s, msg.epoch)))
            self.loop.call_soon_threadsafe(self._kick_metadata, s, frame)

    def _kick_metadata(self, shard: int, frame: Frame) -> None:
        self._md[shard] = frame
        task = self._md_tasks.get(shard)
        if task is None or task.done():
            self._md_tasks[shard] = self.loop.create_task(self._send_metadata(shard))

    async def _send_metadata(self, shard: int) -> None:
        while (frame := self._md.pop(shard, None)) is not None:
            try:
                await self.clients[shard].send_metadata(frame)
                self.contact()
                self.hello_answered.set()
            except (TransportError, MessageError) as e:
                if SETTINGS_DIFFER in str(e):  # cannot heal by retrying: the learner stops, saying why
                    self.inbox.put(Refused(str(getattr(e, "details", e)).removeprefix("Metadata: ")))
                    self.hello_answered.set()
                    return
                self.failed(e)
                log.warning("%s: metadata not delivered to %s: %s", self.node, self._name(shard), e)

    def upload(self, msg: FragmentUpload) -> concurrent.futures.Future:
        """Send a core FragmentUpload; a pending older upload of the same fragment is cancelled.

        Returns a future of the syncer's Ack (it raises TransportError or
        MessageError if the upload failed). ProtocolError (raised here, nothing
        sent) if the message cannot be framed, e.g. it has no payload."""
        shard = 0
        if self.view is not None:
            shard = self.view.shard_of(msg.fragment)
            msg = dataclasses.replace(msg, epoch=self.view.outgoing(shard, msg.epoch))
        frame = serde.to_frame(msg)
        old = self._uploads.get(frame.fragment)
        if old is not None and not old.done():
            old.cancel()
        fut = asyncio.run_coroutine_threadsafe(self._upload(frame, shard), self.loop)
        self._uploads[frame.fragment] = fut
        return fut

    async def _upload(self, frame: Frame, shard: int = 0):
        try:
            ack = await self.clients[shard].upload_fragment(frame)
            self.contact()
            return ack
        except (TransportError, MessageError) as e:
            self.failed(e)
            self.upload_errors += 1
            log.warning("%s: upload of fragment %d failed: %s", self.node, frame.fragment, e)
            raise

    def _request(self, request: ObjectRequest | str) -> tuple[str, int]:
        """(object name, shard that serves it): a fragment's shard for ``fragment/P`` and ``final/P``,
        shard 0 (peer recovery) for the rest. ProtocolError (nothing sent) for a name no syncer serves."""
        if isinstance(request, str):  # the syncer checks the learner bound; here only the form matters
            request = ObjectRequest.parse(request, len(self.codec.layout.fragments), MAX_LEARNERS)
        return request.name, 0 if self.view is None else self.view.routes.serves(request)

    def refetch(self, epoch: int) -> list[int]:
        """The fragments a learner that followed incarnation ``epoch`` fetches to join the syncer: with S shards
        those of the shards that resumed since (``ShardView.refetch``, read on the loop thread, which moves
        the view), else every one."""
        if self.view is None:
            return list(range(len(self.codec.layout.fragments)))

        async def ask() -> list[int]:
            return self.view.refetch(epoch)

        return asyncio.run_coroutine_threadsafe(ask(), self.loop).result(REFETCH_WAIT_S)

    def fetch_fragment(self, request: ObjectRequest | str) -> concurrent.futures.Future:
        """Bulk-fetch ``fragment/P`` or ``final/P`` (an ``ObjectRequest`` or its name).

        The future resolves to a ``BulkFragment`` (fragment, version, global_step, values, ...) with
        owned fp32 values, or raises TransportError / MessageError (the fetch failed) or ProtocolError
        (the object it got is malformed)."""
        name, shard = self._request(request)

        async def fetch():
            data = await self.clients[shard].fetch_bulk_bytes(BulkRequest(self.node, name, {}))
            got = await asyncio.to_thread(serde.fragment_from_bulk, data, self.bulk_codec)
            return got if self.view is None else self.view.update(shard, got)

        return asyncio.run_coroutine_threadsafe(fetch(), self.loop)

    def upload_frame(self, frame: Frame) -> concurrent.futures.Future:
        """Send an already built frame by the Upload RPC (a donor's state); a future of the Ack."""
        return asyncio.run_coroutine_threadsafe(self.client.upload_fragment(frame), self.loop)

    def fetch_bytes(self, request: ObjectRequest | str, max_bytes: int | None = None) -> concurrent.futures.Future:
        """Bulk-fetch the raw bytes of an object (e.g. ``donation/M``); larger than ``max_bytes``
        (default: transport.max_message_bytes) is refused."""
        name, shard = self._request(request)
        bulk = BulkRequest(self.node, name, {})
        return asyncio.run_coroutine_threadsafe(self.clients[shard].fetch_bulk_bytes(bulk, max_bytes), self.loop)

    def wait_uploads(self, budget_s: float) -> None:
        """Wait up to ``budget_s`` for the uploads handed over so far to finish (or fail)."""
        concurrent.futures.wait(list(self._uploads.values()), timeout=budget_s)

    @property
    def bytes_sent(self) -> int:
        return self.metrics.total(self.metrics.bytes_out)

    @property
    def bytes_received(self) -> int:
        return self.metrics.total(self.metrics.bytes_in)

