"""gRPC (HTTP/2) server: raw-bytes generic handlers in front of an application ``Handler``.

No protobuf: every RPC carries our own messages (``messages.py``), chunked where
large (``framing.py``). Application messages are generic ``Frame``s: what they
mean is the handler's business. The server checks the bearer token on every call before
reading anything, validates every message, maps problems to clear status codes
(UNAUTHENTICATED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
ALREADY_EXISTS, DEADLINE_EXCEEDED) and keeps serving other calls.

Who calls is checked before a byte is read (``callers.py``); what the application
plugs in is ``handler.py`` (both re-exported here).

Uploads hold one of ``max_concurrent_uploads`` reassembly slots; one sender (its
authenticated identity) may have ``max_uploads_per_sender`` open, and an upload
that stops sending for ``stream_idle_timeout_s`` is aborted, so idle streams
cannot keep the slots. One upload striped over several Stripe calls (``stripes.py``) counts as one.
A large update is offered on the Subscribe stream and fetched striped (Fetch, ``stripe_fetch.py``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import grpc

from .bulk_serve import bulk_messages
from .callers import IDENTITY_REASONS, MAX_PEER_LINKS, SENDER_HEADER, Callers, abort_call, sender_metadata, uploader
from .config import TransportConfig
from .direct import DirectServer, status_of
from .framing import BufferPool, MessageReader, Prepared
from .handler import BulkSource, Handler, Rejected
from .heap import pin_malloc_thresholds
from .messages import Ack, BulkRequest, Frame, Message, MessageError, Payload, Subscribe, decode_message, encode_message
from .metrics import TransportMetrics
from .probe import MAX_CONCURRENT_PROBES, MAX_PROBE_BYTES, PROBE_MESSAGE_MIN_BYTES, record_link
from .security import (
    certificate_identity, check_token, require_secure_or_loopback, server_credentials, server_ssl_context,
    why_not_listening,
)
from .stripe_fetch import StripeOffers
from .stripes import StripeAssembler

# Re-exported: callers and applications import these from here.
__all__ = ["BulkSource", "Handler", "IDENTITY_REASONS", "MAX_PEER_LINKS", "Rejected", "SENDER_HEADER", "SERVICE",
           "METHODS", "SLOTS_BUSY_WARN_S", "TransportServer", "sender_metadata"]

log = logging.getLogger(__name__)

SERVICE = "wan_diloco.Syncer"
METHODS = ("Metadata", "Upload", "Stripe", "Subscribe", "Fetch", "Bulk", "Probe")
SLOTS_BUSY_WARN_S = 5.0  # every upload slot held this long: one warning per episode


class TransportServer:
    """Serves one ``Handler`` on ``address`` (``host:port``; port 0 picks a free one)."""

    def __init__(
        self,
        handler: Handler,
        token: str,
        config: TransportConfig | None = None,
        address: str = "127.0.0.1:0",
        metrics: TransportMetrics | None = None,
        name: str = "syncer",
        per_sender_tokens: bool = False,
    ) -> None:
        """With ``per_sender_tokens`` every call must name its sender and carry that sender's own
        token, ``derive_token(token, sender)``; a message from anyone else on it is refused. Without,
        the run's token or the declared sender's own is accepted. With mutual TLS and
        ``tls.identity_from_cert`` the caller is its certificate's name, whatever the token."""
        self.handler, token = handler, check_token(token)
        self.config = config or TransportConfig()
        self.config.validate()
        require_secure_or_loopback(address, self.config.tls, self.config.allow_insecure_remote)
        self.address, self.name = address, name
        self.metrics = metrics or TransportMetrics()
        self.callers = Callers(token, per_sender_tokens, certificate_identity(self.config.tls),
                               self.config.max_calls_per_s_per_sender, self.metrics)
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._upload_slots = asyncio.Semaphore(self.config.max_concurrent_uploads)
        self._uploads_by: dict[str, int] = {}  # sender (or "peer HOST") -> its open Upload calls
        self._slots_held = 0
        self._slots_busy_timer: asyncio.TimerHandle | None = None  # armed while every slot is held
        # Told each warning's text too (the syncer makes it an event: the run's log, not only stderr).
        self.on_warning: Callable[[str], None] | None = None
        # sender -> [instance, open Subscribe calls of that instance]
        self._subscribers: dict[str, list] = {}
        # Idle receive buffers kept for reuse: never more than the uploads in flight.
        self._pool = BufferPool(keep=self.config.max_concurrent_uploads)
        self._stripes = StripeAssembler(self.config, self._pool, self._begin_upload, self._end_upload,
                                        self._deliver, self.callers.bind, self.metrics)
        self._offers = StripeOffers(self.config, name, self.metrics)
        self._direct = DirectServer(self.config, self.callers, self._stripes, self.metrics)
        self._probes = 0
        # sender -> its latest link measurement as it reported it (``Probe`` meta): for /status.
        self.peer_links: dict[str, dict] = {}

    async def start(self) -> int:
        """Bind and start; returns the port."""
        pin_malloc_thresholds()  # received messages reuse heap pages instead of fresh ones (heap.py)
        handlers = {
            "Metadata": grpc.unary_unary_rpc_method_handler(self._metadata),
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
            "Stripe": grpc.stream_unary_rpc_method_handler(self._stripe),
            "Subscribe": grpc.unary_stream_rpc_method_handler(self._subscribe),
            "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
            "Bulk": grpc.unary_stream_rpc_method_handler(self._bulk),
            "Probe": grpc.unary_stream_rpc_method_handler(self._probe),
        }  # no (de)serializers: requests and responses are raw bytes
        credentials = server_credentials(self.config.tls) if self.config.tls is not None else None
        server = grpc.aio.server(options=self.config.server_options())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            try:
                if credentials is not None:
                    port = server.add_secure_port(self.address, credentials)
                else:
                    port = server.add_insecure_port(self.address)
            except RuntimeError:  # gRPC's "Failed to bind to address ...", without the reason
                raise why_not_listening(self.address) from None
            await server.start()
            if self.config.direct_port:  # direct stripes (direct.py) beside gRPC, on the same host
                tls = self.config.tls
                await self._direct.start(self.address.rpartition(":")[0], self.config.direct_port,
                                         server_ssl_context(tls) if tls is not None else None)
        except BaseException:
            await server.stop(None)
            raise
        self._server, self.port = server, port
        return port

    @property
    def target(self) -> str:
        """``host:port`` for clients."""
        host = self.address.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self._direct.stop()
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace_s)

    async def __aenter__(self) -> "TransportServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- plumbing ----------------------------------------------------------

    async def _fail(self, context: grpc.aio.ServicerContext, rpc: str, code: grpc.StatusCode, detail: str):
        await abort_call(self.metrics, context, rpc, code, detail)

    def _decode(self, data: Payload, expected: type, limit: int) -> Message:
        msg = decode_message(data, max_bytes=limit)
        if not isinstance(msg, expected):
            raise MessageError(f"expected {expected.__name__}, got {type(msg).__name__}")
        return msg

    async def _guard(self, context, rpc: str, error: BaseException) -> None:
        """Turn an exception from decoding or the handler into a status (or re-raise)."""
        if not isinstance(error, Exception) or isinstance(error, grpc.aio.AbortError):
            raise error  # cancellation, generator close, or a status already set
        code, detail = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s handler failed", rpc, exc_info=error)
        await self._fail(context, rpc, code, detail)

    def _ack(self, rpc: str, ack: Ack | None) -> bytes:
        data = encode_message(ack if ack is not None else Ack(sender=self.name))
        self.metrics.sent(rpc, len(data))
        return data

    # ---- RPCs --------------------------------------------------------------

    async def _metadata(self, request: bytes, context) -> bytes:
        who = await self.callers.auth(context, "Metadata")
        await self.callers.rate(context, "Metadata", who)
        try:
            msg = self._decode(request, Frame, self.config.grpc_message_bytes)
            self.callers.bind(who, msg.sender)
            self.metrics.received("Metadata", len(request))
            return self._ack("Metadata", await self.handler.on_metadata(msg))
        except BaseException as e:
            await self._guard(context, "Metadata", e)


    async def _begin_upload(self, who: str) -> None:
        """Count an upload of ``who`` (Rejected over ``max_uploads_per_sender``), then hold one of
        ``max_concurrent_uploads`` slots. When every slot stays held for SLOTS_BUSY_WARN_S, one warning
        names who holds them: whether or not an upload is waiting here, a learner's own uploads may be
        held back on its side, and merges stop."""
        limit = self.config.max_uploads_per_sender
        if self._uploads_by.get(who, 0) >= limit:
            raise Rejected(f"{who} has {limit} uploads open already, the limit (max_uploads_per_sender); "
                           "wait for one to finish", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._uploads_by[who] = self._uploads_by.get(who, 0) + 1
        try:
            # The slot bounds memory (max_concurrent_uploads x max_message_bytes); while a
            # call waits for one, HTTP/2 flow control holds its sender back.
            await self._upload_slots.acquire()
        except BaseException:
            self._uncount(who)
            raise
        self._slots_held += 1
        self.metrics.gauge("upload_slots_in_use", "Upload reassembly slots held").set(self._slots_held)
        if self._slots_held >= self.config.max_concurrent_uploads and self._slots_busy_timer is None:
            self._slots_busy_timer = asyncio.get_running_loop().call_later(SLOTS_BUSY_WARN_S, self._warn_slots_busy)

    def _uncount(self, who: str) -> None:
        self._uploads_by[who] -= 1
        if not self._uploads_by[who]:
            del self._uploads_by[who]

    def _end_upload(self, who: str) -> None:
        self._slots_held -= 1
        self.metrics.gauge("upload_slots_in_use", "Upload reassembly slots held").set(self._slots_held)
        if self._slots_busy_timer is not None:  # a slot is free: this episode is over
            self._slots_busy_timer.cancel()
            self._slots_busy_timer = None
        self._upload_slots.release()
        self._uncount(who)

    def _warn_slots_busy(self) -> None:
        top = sorted(self._uploads_by.items(), key=lambda kv: -kv[1])[:8]
        what = (f"all {self.config.max_concurrent_uploads} upload slots (transport.max_concurrent_uploads) have been "
                f"busy for over {SLOTS_BUSY_WARN_S:.0f} s: uploads wait and merges are delayed; open uploads by "
                "sender: " + ", ".join(f"{who!r} x{n}" for who, n in top))  # repr: names are the callers' text
        log.warning("%s", what)
        if self.on_warning is not None:
            self.on_warning(what)

    async def _upload(self, request_iterator, context) -> bytes:
        bound = await self.callers.auth(context, "Upload")  # before a slot or a byte: a stranger takes neither
        who = bound or uploader(context)
        try:
            await self._begin_upload(who)
        except Rejected as e:
            await self._fail(context, "Upload", e.code, str(e))
        try:
            return await self._receive_upload(request_iterator, context, bound)
        finally:
            self._end_upload(who)

    async def _stripe(self, request_iterator, context) -> bytes:
        """One stripe of an upload striped over several calls (``stripes.py``)."""
        bound = await self.callers.auth(context, "Stripe")
        try:
            return await self._stripes.receive(request_iterator, bound, bound or uploader(context))
        except BaseException as e:
            await self._guard(context, "Stripe", e)

    async def _fetch(self, request: bytes, context):
        """One stripe of an update offered striped on this caller's Subscribe stream (``stripe_fetch.py``)."""
        bound = await self.callers.auth(context, "Fetch")
        try:
            async for data in self._offers.serve(request, bound or uploader(context)):
                yield data
        except BaseException as e:
            await self._guard(context, "Fetch", e)

    async def _deliver(self, msg: Frame) -> bytes:
        return self._ack("Upload", await self.handler.on_fragment(msg))

    async def _receive_upload(self, request_iterator, context, bound: str | None) -> bytes:
        idle_s, quiet, nbytes = self.config.stream_idle_timeout_s, None, 0
        try:
            reader, done = MessageReader(self.config.max_message_bytes, self._pool), []
            # A sender that stops mid-upload would keep its slot until the call's deadline
            # (minutes for a large fragment): each chunk must come within idle_s.
            async with asyncio.timeout(idle_s) as quiet:
                async for chunk in request_iterator:
                    quiet.reschedule(asyncio.get_running_loop().time() + idle_s)
                    nbytes += len(chunk)
                    done += reader.feed(chunk)
                    if len(done) > 1:
                        raise MessageError("an upload carries exactly one message, got more")
            if not done or not reader.idle:
                raise MessageError(f"upload ended mid-message after {nbytes} bytes")
            msg = done[0]
            if not isinstance(msg, Frame):
                raise MessageError(f"expected Frame, got {type(msg).__name__}")
            self.callers.bind(bound, msg.sender)
            self.metrics.received("Upload", nbytes, 1)
            return await self._deliver(msg)
        except BaseException as e:
            if isinstance(e, TimeoutError) and quiet is not None and quiet.expired():
                await self._fail(context, "Upload", grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no data for {idle_s:g} s (stream_idle_timeout_s) after {nbytes} bytes; "
                                 "aborted to free its upload slot")
            await self._guard(context, "Upload", e)

    def _claim_subscription(self, msg: Subscribe) -> None:
        """Count an open Subscribe call of ``msg.sender``; Rejected if another process holds one.

        The same instance again is a reconnect of the same process (its old call may
        not have ended yet here): let through, the handler replaces the old stream.
        A different instance while a call is open is a second process with the same
        id: taking over would kill the first one's stream, so it is refused instead.
        A dead process's call ends by TCP reset or keepalive, then a new one gets in.
        """
        held = self._subscribers.get(msg.sender)
        if held is None:
            self._subscribers[msg.sender] = [msg.instance, 1]
        elif held[0] == msg.instance:
            held[1] += 1
        else:
            raise Rejected(f"{msg.sender} is already subscribed from another process (instance {held[0]}); "
                           "is the same --id running twice?", grpc.StatusCode.ALREADY_EXISTS)

    def _release_subscription(self, msg: Subscribe) -> None:
        held = self._subscribers.get(msg.sender)
        if held is not None and held[0] == msg.instance:
            held[1] -= 1
            if not held[1]:
                del self._subscribers[msg.sender]

    async def _subscribe(self, request: bytes, context):
        who = await self.callers.auth(context, "Subscribe")
        try:
            msg = self._decode(request, Subscribe, self.config.grpc_message_bytes)
            self.callers.bind(who, msg.sender)
            self._claim_subscription(msg)  # before the handler: it would end the other stream
        except BaseException as e:
            await self._guard(context, "Subscribe", e)
            return
        try:
            try:
                updates = self.handler.subscribe(msg)
            except BaseException as e:
                await self._guard(context, "Subscribe", e)
                return
            self.metrics.received("Subscribe", len(request))
            try:
                async for item in updates:
                    if not isinstance(item, Prepared):
                        if not isinstance(item, Frame):
                            raise TypeError(f"subscribe() yielded {type(item).__name__}, not Frame or Prepared")
                        item = Prepared.of(item, self.config.chunk_bytes)
                    async with contextlib.aclosing(self._offers.send(item, who or uploader(context))) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    self.metrics.sent("Subscribe", item.nbytes)
            except BaseException as e:
                await self._guard(context, "Subscribe", e)
            finally:
                aclose = getattr(updates, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            self._release_subscription(msg)

    async def _bulk(self, request: bytes, context):
        who = await self.callers.auth(context, "Bulk")
        await self.callers.rate(context, "Bulk", who)
        try:
            req = self._decode(request, BulkRequest, self.config.grpc_message_bytes)
            self.callers.bind(who, req.sender)
            self.metrics.received("Bulk", len(request))
            source = await self.handler.bulk(req)
            async for data in bulk_messages(self.name, req, source, self.config.chunk_bytes, self.metrics):
                yield data
        except BaseException as e:
            await self._guard(context, "Bulk", e)

    async def _probe(self, request: bytes, context):
        """Stream ``meta["bytes"]`` zero bytes back: the sender times it (``probe.py``)."""
        who = await self.callers.auth(context, "Probe")
        await self.callers.rate(context, "Probe", who)
        try:
            msg = self._decode(request, Frame, self.config.grpc_message_bytes)
            self.callers.bind(who, msg.sender)
            nbytes = msg.meta.get("bytes")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_PROBE_BYTES:
                raise MessageError(f"probe meta.bytes must be an integer in [0, {MAX_PROBE_BYTES}], got {nbytes!r}")
            if self._probes >= MAX_CONCURRENT_PROBES:
                raise Rejected(f"{self._probes} probes in progress already", grpc.StatusCode.RESOURCE_EXHAUSTED)
        except BaseException as e:
            await self._guard(context, "Probe", e)
            return
        self.metrics.received("Probe", len(request))
        record_link(self.peer_links, self.metrics, msg.sender, msg.meta, MAX_PEER_LINKS)
        self._probes += 1
        try:
            if nbytes == 0:
                yield b""
                return
            # Small messages (about 64 per probe): a probe cut short still counts what arrived.
            zeros = bytes(min(self.config.chunk_bytes, max(PROBE_MESSAGE_MIN_BYTES, nbytes // 64)))
            for offset in range(0, nbytes, len(zeros)):
                part = zeros if offset + len(zeros) <= nbytes else zeros[: nbytes - offset]
                self.metrics.sent("Probe", len(part))
                yield part
        finally:
            self._probes -= 1
