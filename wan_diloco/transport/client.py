"""gRPC (HTTP/2) client of the syncer: metadata and fragment Frames up, Frames down, bulk.

Several channels (TCP connections) per peer; uploads go round-robin over them. Every call has a deadline
and its sender's token (a learner's own; the run's token is never sent, only what it derives for the
sender: ``security.call_token``); calls that fail with UNAVAILABLE are retried with exponential backoff and
jitter for up to ``retry_budget_s`` (gRPC itself reconnects the channel with the same backoff settings).
Every other status (e.g. ALREADY_EXISTS: another process subscribed as our sender) is final and raised
as ``TransportError``."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import secrets
import time
from typing import AsyncIterator

import grpc

from .config import MAX_CHANNELS, PROBE_TUNED, TransportConfig, tune_for_link
from .direct_send import DirectLinks
from .framing import BufferPool, MessageReader, iter_chunks
from .heap import pin_malloc_thresholds
from .messages import (
    Ack, BulkChunk, BulkRequest, Frame, MessageError, StripeOffer, Subscribe, TRAILER_BYTES, decode_message,
    encode_message, encode_parts,
)
from .metrics import TransportMetrics
from .probe import LinkSample, rate_from_transfer
from .retry import Backoff, TransportError, worth_retrying
from .security import bearer_metadata, call_token, channel_credentials, check_token, require_secure_or_loopback
from .server import SERVICE, sender_metadata
from .stripe_fetch import fetch_assembler, fetch_striped
from .stripes import send_striped, stripe_count

__all__ = ["Backoff", "SyncerClient", "TransportError"]  # Backoff and TransportError live in retry.py


class SyncerClient:
    """Talks to one syncer at ``target`` (``host:port``). Use as ``async with``."""

    def __init__(self, target: str, token: str, config: TransportConfig | None = None,
                 metrics: TransportMetrics | None = None) -> None:
        self.config = config or TransportConfig()
        self.config.validate()
        pin_malloc_thresholds()  # a learner receives updates as the server receives uploads (heap.py)
        require_secure_or_loopback(target, self.config.tls, self.config.allow_insecure_remote)
        self.target = target
        self.metrics = metrics or TransportMetrics()
        self._token = check_token(token)
        self._metadata_of: dict[str, tuple] = {}  # sender -> its call metadata (token, name)
        # Names this process in Subscribe: the syncer refuses a second process subscribing
        # as the same sender instead of letting it take over the first one's stream.
        self.instance = secrets.token_hex(8)
        self._channels: list[grpc.aio.Channel] = []
        self._next_channel = itertools.count()
        # The syncer refuses a sender's uploads beyond max_uploads_per_sender (same [transport]
        # table on both sides), so more in flight would only fail.
        self._upload_slots = asyncio.Semaphore(min(self.config.max_inflight_uploads,
                                                   self.config.max_uploads_per_sender))
        self._closed = False
        self.link: LinkSample | None = None  # the last probe's measurement: sizes later connections
        self._direct = DirectLinks(target, self._token, self.config) if self.config.direct_port else None

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC options of the next connection opened: after a probe, the HTTP/2 window, frame and read
        sizes ``tune_for_link`` picks for the measured rate x RTT. The message size stays ``chunk_bytes``
        (the syncer refuses larger gRPC messages than its own)."""
        if self.link is None:
            return self.config.client_options()
        tuned = tune_for_link(self.link.rate_gbit_s, self.link.rtt_s, self.config)
        return dataclasses.replace(self.config, **{k: getattr(tuned, k) for k in PROBE_TUNED}).client_options()

    def _open_channel(self) -> grpc.aio.Channel:
        options = self.channel_options()
        tls = self.config.tls
        if tls is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.aio.secure_channel(self.target, channel_credentials(tls), options=options)

    async def connect(self) -> "SyncerClient":
        """Open the channels (connections are made lazily by the first call)."""
        if not self._channels:
            self._channels = [self._open_channel() for _ in range(self.config.channels)]
        return self

    @property
    def channels(self) -> int:
        return len(self._channels)

    async def widen(self, channels: int) -> int:
        """Open connections until there are ``channels`` (never closes any); returns how many were added.
        New uploads and probes spread over all of them; calls in flight stay where they are."""
        if not self._channels:
            raise RuntimeError("SyncerClient is not connected (use `async with` or connect())")
        add = max(0, min(channels, MAX_CHANNELS) - len(self._channels))
        self._channels += [self._open_channel() for _ in range(add)]
        return add

    async def close(self) -> None:
        self._closed = True
        if self._direct is not None:
            await self._direct.close()
        channels, self._channels = self._channels, []
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    async def __aenter__(self) -> "SyncerClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _channel(self, index: int | None = None) -> grpc.aio.Channel:
        if not self._channels:
            raise RuntimeError("SyncerClient is not connected (use `async with` or connect())")
        i = next(self._next_channel) if index is None else index
        return self._channels[i % len(self._channels)]

    async def _retry(self, rpc: str, attempt):
        """Run ``attempt()`` until it succeeds, fails for good, or the budget runs out."""
        backoff = Backoff(self.config)
        while True:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as e:
                self.metrics.error(rpc, e.code().name)
                if worth_retrying(e) and not self._closed and await backoff.wait():
                    continue
                raise TransportError(rpc, e.code(), e.details() or "") from None

    def _metadata(self, sender: str) -> tuple:
        """Call metadata speaking as ``sender``: its own token (``call_token``) and its name."""
        md = self._metadata_of.get(sender)
        if md is None:
            if len(self._metadata_of) >= 64:  # a client speaks as one or a few senders: bounded anyway
                self._metadata_of.clear()
            md = self._metadata_of[sender] = bearer_metadata(call_token(self._token, sender)) + (
                sender_metadata(sender),)
        return md

    def _decode_ack(self, data: bytes) -> Ack:
        msg = decode_message(data, max_bytes=self.config.grpc_message_bytes)
        if not isinstance(msg, Ack):
            raise MessageError(f"expected Ack, got {type(msg).__name__}")
        return msg

    async def send_metadata(self, frame: Frame) -> Ack:
        """Send one small Frame as a unary call (the Metadata RPC); returns the syncer's Ack.

        MessageError if it cannot be encoded; it must fit one gRPC message."""
        if not isinstance(frame, Frame):
            raise MessageError(f"send_metadata takes a Frame, got {type(frame).__name__}")
        data = encode_message(frame)
        if len(data) > self.config.grpc_message_bytes:
            raise MessageError(f"metadata frame of {len(data)} bytes exceeds one gRPC message "
                               f"({self.config.grpc_message_bytes}); send large payloads with upload_fragment")

        async def attempt():
            call = self._channel(0).unary_unary(f"/{SERVICE}/Metadata")
            reply = await call(data, timeout=self.config.call_timeout_s, wait_for_ready=True,
                               metadata=self._metadata(frame.sender))
            self.metrics.sent("Metadata", len(data))
            return reply

        return self._decode_ack(await self._retry("Metadata", attempt))

    async def upload_fragment(self, frame: Frame) -> Ack:
        """Stream one Frame in chunks of ``chunk_bytes`` over the next channel (the Upload RPC), or, when
        it is at least twice ``stripe_min_bytes`` and there are several channels, striped over them (the
        Stripe RPC, ``stripes.py``; direct stripes with ``direct_port``, ``direct.py``). At most
        ``max_inflight_uploads`` (and ``max_uploads_per_sender``) run at once; more callers wait here, so a
        learner never queues more than that many fragments in memory."""
        if not isinstance(frame, Frame):
            raise MessageError(f"upload_fragment takes a Frame, got {type(frame).__name__}")
        head, payload = encode_parts(frame)  # chunks are sliced and checksummed lazily, per try
        size = len(head) + len(payload) + TRAILER_BYTES
        if size > self.config.max_message_bytes:
            raise MessageError(f"fragment of {size} bytes exceeds max_message_bytes {self.config.max_message_bytes}")
        metadata = self._metadata(frame.sender)
        stripes = stripe_count(len(self._channels), size, self.config.stripe_min_bytes)

        async def attempt():
            deadline_s = self.config.upload_deadline_s(size)
            if stripes > 1 and self._direct is not None:  # TLS straight into the syncer's buffer
                reply = await self._direct.send(frame, head, payload, stripes, deadline_s)
            elif stripes > 1:  # one stream per connection: one fragment can use them all
                reply = await send_striped(self._channels, next(self._next_channel), f"/{SERVICE}/Stripe", frame,
                                           head, payload, stripes, self.config.chunk_bytes, deadline_s, metadata)
            else:
                call = self._channel().stream_unary(f"/{SERVICE}/Upload")
                reply = await call(iter_chunks(head, payload, self.config.chunk_bytes),
                                   timeout=deadline_s, metadata=metadata, wait_for_ready=True)
            self.metrics.sent("Upload", size)
            return reply

        async with self._upload_slots:
            return self._decode_ack(await self._retry("Upload", attempt))

    async def subscribe(self, sender: str, region: str) -> AsyncIterator[Frame]:
        """Frames published for ``sender`` for as long as the caller iterates.

        The call is renewed every ``subscribe_renew_s``, make before break (docs/protocol.md): the next
        call opens, the syncer ends this one after the update it is sending, and nothing is lost. While
        the syncer is down the call waits (frames queue there, newest per fragment); a dropped
        connection is retried with backoff. TransportError for other errors (UNAUTHENTICATED;
        ALREADY_EXISTS: another process subscribed as ``sender``) or past ``retry_budget_s``. The
        iteration ends when the server ends the stream for another reason (a newer subscription of
        ours replaced it). A large update offered striped is fetched over every connection.
        """
        request = encode_message(Subscribe(sender=sender, region=region, instance=self.instance))
        backoff, pool = Backoff(self.config), BufferPool(keep=2)
        assembler = fetch_assembler(self.config, pool, self.metrics)
        renew_s = self.config.subscribe_renew_s

        def open_call():  # the deadline only backs a renewal up: an update it cuts goes back to the mailbox
            return self._channel(0).unary_stream(f"/{SERVICE}/Subscribe")(
                request, timeout=renew_s + self.config.call_timeout_s, wait_for_ready=True,
                metadata=self._metadata(sender))

        call, taking_over = None, []
        try:
            while not self._closed:
                call = taking_over.pop() if taking_over else open_call()
                renewal = asyncio.get_running_loop().call_later(
                    renew_s, lambda: None if self._closed else taking_over.append(open_call()))
                reader = MessageReader(self.config.max_message_bytes, pool)
                try:
                    async for chunk in call:
                        self.metrics.received("Subscribe", len(chunk), 0)
                        for msg in reader.feed(chunk):
                            if isinstance(msg, StripeOffer):
                                msg = await fetch_striped(assembler, self._channels, next(self._next_channel),
                                                          f"/{SERVICE}/Fetch", msg, sender, self._metadata(sender))
                            if not isinstance(msg, Frame):
                                raise MessageError(f"subscribe expected Frame, got {type(msg).__name__}")
                            self.metrics.messages.labels("Subscribe", "in").inc()
                            backoff.reset()
                            yield msg
                    if not taking_over:
                        return  # ended by the server, not by our renewal
                    backoff.reset()
                except grpc.aio.AioRpcError as e:
                    if self._closed:
                        return
                    if taking_over or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        backoff.reset()
                        continue  # a renewal: the next call takes over (its update went back to the mailbox)
                    self.metrics.error("Subscribe", e.code().name)
                    if worth_retrying(e) and await backoff.wait():
                        continue
                    raise TransportError("Subscribe", e.code(), e.details() or "") from None
                finally:
                    renewal.cancel()
                    call.cancel()
        finally:
            for c in taking_over:
                c.cancel()

    async def _probe_call(self, channel: int, sender: str, nbytes: int, report: dict,
                          got: list[int] | None = None) -> int:
        """One Probe call on ``channel``; bytes received are also added to ``got[0]`` as they arrive."""
        request = encode_message(Frame(sender=sender, fragment=0, meta={"bytes": nbytes, **report}))
        call = self._channel(channel).unary_stream(f"/{SERVICE}/Probe")(
            request, timeout=self.config.upload_deadline_s(nbytes), wait_for_ready=True,
            metadata=self._metadata(sender))
        n = 0
        try:
            async for chunk in call:
                n += len(chunk)
                if got is not None:
                    got[0] += len(chunk)
        except grpc.aio.AioRpcError as e:
            self.metrics.error("Probe", e.code().name)
            raise TransportError("Probe", e.code(), e.details() or "") from None
        finally:
            call.cancel()
            self.metrics.received("Probe", n)
        if n != nbytes:
            raise MessageError(f"probe asked for {nbytes} bytes, got {n}")
        return n

    async def probe(self, sender: str, nbytes: int, report: dict | None = None, rtt_tries: int = 3,
                    max_s: float | None = None) -> LinkSample:
        """Measure the link to the server (``probe.py``): RTT, then ``nbytes`` spread over every channel.

        ``report`` (e.g. the previous sample's ``to_event()``) travels in the
        request so the server can show it. A transfer still running after
        ``max_s`` is cut short and measured on what arrived, so a probe sized
        for a faster link never hogs a slow one. Not retried: a failed probe
        is simply a missing sample."""
        report = dict(report or {})
        n = len(self._channels)
        # Every connection up first, so no handshake is timed as RTT or transfer.
        await asyncio.gather(*(self._probe_call(i, sender, 0, report) for i in range(n)))
        rtt_s = math.inf
        for _ in range(max(1, rtt_tries)):
            t0 = time.monotonic()
            await self._probe_call(0, sender, 0, report)
            rtt_s = min(rtt_s, time.monotonic() - t0)
        shares = [nbytes // n + (1 if i < nbytes % n else 0) for i in range(n)]
        got = [0]
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(self._probe_call(i, sender, b, report, got)) for i, b in enumerate(shares) if b]
        done, pending = await asyncio.wait(tasks, timeout=max_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.monotonic() - t0
        for t in done:
            t.result()  # a failed call fails the probe
        rate, transfer_s = rate_from_transfer(got[0], wall_s, rtt_s)
        sample = LinkSample(rtt_s=rtt_s, rate_gbit_s=rate, nbytes=got[0], transfer_s=transfer_s, at_s=time.monotonic())
        if rate > 0:
            self.link = sample
        return sample

    async def fetch_bulk(self, request: BulkRequest) -> AsyncIterator[BulkChunk]:
        """Chunks of a bulk object in order; checks offsets, total size and version (etag).

        A call that breaks with a retryable status (UNAVAILABLE) is tried again with
        backoff: from the start if no chunk had arrived; else, if the object is
        resumable (its chunks carry an etag), from the first missing byte, asking
        for that same etag (counted in ``metrics.resumes``). The retry budget
        counts time without progress, so a long transfer may resume many times.
        If the object changed in the meantime the server refuses and this raises
        TransportError (FAILED_PRECONDITION): the bytes already yielded belong to
        a version that is gone, and the caller must fetch it again from offset 0.
        A broken transfer of a non-resumable object raises TransportError.
        """
        backoff = Backoff(self.config)
        received = request.offset  # absolute offset of the next byte expected
        total = etag = None  # from the first chunk; every later one, resumed calls too, must agree
        attempt = request
        while True:
            call = self._channel(0).unary_stream(f"/{SERVICE}/Bulk")(
                encode_message(attempt), timeout=self.config.upload_deadline_s(self.config.max_message_bytes),
                metadata=self._metadata(request.sender), wait_for_ready=True,
            )
            index = 0  # chunk indices restart at 0 in every call
            try:
                async for raw in call:
                    chunk = decode_message(raw, max_bytes=self.config.grpc_message_bytes)
                    if not isinstance(chunk, BulkChunk) or chunk.name != request.name:
                        raise MessageError(f"bulk {request.name!r}: unexpected {type(chunk).__name__}")
                    if total is None:
                        total, etag = chunk.total_bytes, chunk.etag
                    if (chunk.index, chunk.offset, chunk.total_bytes, chunk.etag) != (index, received, total, etag):
                        raise MessageError(
                            f"bulk {request.name!r}: got chunk {chunk.index} at offset {chunk.offset} of "
                            f"{chunk.total_bytes} (etag {chunk.etag[:80]!r}), expected chunk {index} at {received} "
                            f"of {total} (etag {etag[:80]!r})"
                        )
                    if index == 0:
                        backoff.reset()  # progress: the budget is for time without any
                    index, received = index + 1, received + len(chunk.payload)
                    if received > total:
                        raise MessageError(f"bulk {request.name!r}: more than the announced {total} bytes")
                    self.metrics.received("Bulk", len(raw))
                    yield chunk
                if total is None or received != total:
                    raise MessageError(f"bulk {request.name!r}: ended after {received} of {total} bytes")
                return
            except grpc.aio.AioRpcError as e:
                self.metrics.error("Bulk", e.code().name)
                # Nothing arrived yet: try again as asked. Part arrived: only a resumable object
                # (etag) can continue where it stopped; any other would have to start over,
                # which the caller (holding the first part) must decide.
                retry = worth_retrying(e) and not self._closed and (total is None or etag)
                # The call's deadline is sized for max_message_bytes; an object larger than that (a
                # learner's whole state) that was still arriving goes on in a new call.
                retry = retry or (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and index > 0 and bool(etag)
                                  and not self._closed)
                if retry and await backoff.wait():
                    if total is not None:
                        attempt = dataclasses.replace(request, offset=received, etag=etag)
                        self.metrics.resumed("Bulk")
                    continue
                if attempt is not request and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise TransportError("Bulk", e.code(), (
                        f"bulk {request.name!r} changed while it was being fetched: resuming at byte {received} "
                        f"of {total} was refused ({e.details() or 'no details'}); the bytes received so far "
                        "are of a version that is gone")) from None
                raise TransportError("Bulk", e.code(), e.details() or "") from None
            finally:
                call.cancel()

    async def fetch_bulk_bytes(self, request: BulkRequest, max_bytes: int | None = None) -> bytearray:
        """A whole bulk object in memory (refused if larger than ``max_bytes``)."""
        limit = self.config.max_message_bytes if max_bytes is None else max_bytes
        out: bytearray | None = None
        async for chunk in self.fetch_bulk(request):
            if out is None:
                if chunk.total_bytes > limit:
                    raise MessageError(f"bulk {request.name!r}: {chunk.total_bytes} bytes exceeds limit {limit}")
                out = bytearray(chunk.total_bytes)
            out[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        return out if out is not None else bytearray()
