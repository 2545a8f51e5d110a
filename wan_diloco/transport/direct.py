"""Direct stripes: an upload's stripes over plain TLS connections, decrypted straight into the upload's buffer.

Through gRPC the receiver copies each byte about four times in user space (the
C core assembles every message out of its TLS records, hands it to Python as a
new ``bytes``, which is copied into the reassembly buffer): 2.3-2.9x the CPU per
GiB of a raw TLS receiver (docs/benchmarks.md). Here TLS decrypts each stripe
into the pooled buffer the message is decoded from (``asyncio.BufferedProtocol``:
no read happens until a destination is named), so a receiving core carries about
what raw TLS does. It is opt-in (``transport.direct_port``, the same on both
sides); metadata, updates, probes and uploads too small to stripe stay on gRPC.

Wire, per connection (TLS when ``transport.tls`` is set; cleartext only where
gRPC may be), client first:

- hello: ``WDLD``, a version byte, a u32 length, that many bytes of JSON
  ``{"sender": ..., "token": ...}`` (the sender and token a gRPC call carries in
  its metadata); answered by a reply.
- stripe: a u32 length, the stripe's header message (the Frame a Stripe call
  sends first), then exactly the header's ``length`` bytes; answered by a reply
  once the whole upload is in (or failed).
- reply: a status byte (0 OK, else the gRPC status code's number), a u32 length,
  then the Ack message or a UTF-8 reason.

The hello is checked as a call's metadata is (``callers.py``), each stripe as a
Stripe call's (``stripes.py``: one assembly, one slot per upload, the same
checksums, limits and timeouts). After an error the connection is answered and
closed; integers are big-endian.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from urllib.parse import quote

import grpc
import xxhash

from .callers import SENDER_HEADER, Callers
from .handler import Rejected
from .messages import MAX_NAME_CHARS, MessageError, OversizedError
from .metrics import TransportMetrics
from .security import AUTH_HEADER, listen_error, peer_common_name
from .stripes import StripeAssembler, StripeTimeout

log = logging.getLogger(__name__)

MAGIC, VERSION = b"WDLD", 1
HELLO = struct.Struct(">4sBI")
LENGTH = struct.Struct(">I")
REPLY = struct.Struct(">BI")
MAX_HELLO_BYTES = 4096
MAX_HEADER_BYTES = 64 << 10  # a stripe's header message (a Frame with its stripe meta: a few hundred bytes)
MAX_TOKEN_CHARS = 1024
LINGER_S = 1.0
SPILL_BYTES = 256 << 10  # what one read may bring in while no destination is named
MAX_CONNECTIONS = 1024  # open direct connections a server keeps; more are closed at once
# A connection waits this long for its next stripe (clients keep theirs for uploads to come, and drop
# them after CLIENT_IDLE_S, so they never send into one the server is closing).
IDLE_CONNECTION_S, CLIENT_IDLE_S = 600.0, 300.0
CODES = {code.value[0]: code for code in grpc.StatusCode}
RPC = "Direct"


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed call answers with, for what the transport raises."""
    if isinstance(error, OversizedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, MessageError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, Rejected):
        return error.code, str(error)
    if isinstance(error, StripeTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    return grpc.StatusCode.INTERNAL, f"handler failed: {type(error).__name__}: {error}"


class Refused(Exception):
    """A direct connection's caller refused (``Callers`` aborts through ``_Caller.abort``)."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code


class _Caller:
    """What ``Callers.auth`` reads of a gRPC call, for a direct connection's hello."""

    def __init__(self, sender: str, token: str, common_name: str | None, peer: object) -> None:
        self._metadata = ((AUTH_HEADER, f"Bearer {token}"), (SENDER_HEADER, quote(sender, safe="")))
        self._names = {"x509_common_name": [common_name.encode()]} if common_name is not None else {}
        self._peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unknown"

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self) -> dict:
        return self._names

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, detail: str):
        raise Refused(code, detail)


class Connection(asyncio.BufferedProtocol):
    """A stream read into the buffer its reader names (``read_into``): bytes land where they are used.
    While none is named it stops reading (TCP flow control holds the sender back); what a read brought in
    meanwhile (uvloop may start reading before ``connection_made``'s pause takes) waits in a small spill
    buffer for the next ``read_into``."""

    def __init__(self, serve) -> None:
        self._serve, self.transport, self._lost = serve, None, None
        self._view: memoryview | None = None
        self._want = self._got = 0
        self._waiter, self._progress, self._diverted = None, None, False
        self._spill, self._spill_at, self._spilled = bytearray(SPILL_BYTES), 0, 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self._serve(self))

    def get_buffer(self, sizehint: int):
        # No pause, close or abort in here: uvloop cannot take them mid-read (they wait for buffer_updated).
        if self._diverted:
            return memoryview(self._spill)[: min(SPILL_BYTES, self._want - self._got)]
        if self._view is None:
            return memoryview(self._spill)[self._spilled :]
        return self._view[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._waiter is None:
            self._spilled += nbytes
            self.transport.pause_reading()
            return
        self._got += nbytes
        if self._progress is not None:
            self._progress()
        if self._got == self._want:
            self.transport.pause_reading()
            self._wake(None)

    @property
    def got(self) -> int:
        """Bytes of the current read in so far."""
        return self._got

    def divert(self) -> None:
        """Drop the rest of the current read instead of writing it: its buffer is not ours any more."""
        self._view, self._diverted = None, True

    def eof_received(self) -> bool:
        self._wake(EOFError("the peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("connection closed")
        self._wake(self._lost)

    def _wake(self, error: BaseException | None) -> None:
        waiter, self._waiter = self._waiter, None
        self._view, self._diverted, self._progress = None, False, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None) if error is None else waiter.set_exception(error)

    async def read_into(self, view, progress=None) -> None:
        """Fill ``view`` (a writable buffer) from the stream; ``progress()`` runs after each read."""
        view = memoryview(view).cast("B")
        take = min(self._spilled - self._spill_at, len(view))
        if take:  # bytes read before anyone asked for them come first
            view[:take] = self._spill[self._spill_at : self._spill_at + take]
            self._spill_at += take
            if self._spill_at == self._spilled:
                self._spill_at = self._spilled = 0
            if take == len(view):
                return
        if self._lost is not None:
            raise ConnectionError("connection closed")
        self._view, self._want, self._got, self._progress = view, len(view), take, progress
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.resume_reading()
        await self._waiter

    def reply(self, code: grpc.StatusCode, data: bytes) -> None:
        if self._lost is None and not self.transport.is_closing():
            self.transport.write(REPLY.pack(code.value[0], len(data)) + data)


class DirectServer:
    """Direct stripes for a ``TransportServer``: its callers' checks, its stripe assembler, its metrics."""

    def __init__(self, config, callers: Callers, assembler: StripeAssembler, metrics: TransportMetrics) -> None:
        self.config, self.callers, self.assembler, self.metrics = config, callers, assembler, metrics
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self.port = self.accepted = 0

    async def start(self, host: str, port: int, ssl_context) -> int:
        loop = asyncio.get_running_loop()
        try:
            tls = {"ssl": ssl_context, "ssl_handshake_timeout": self.config.call_timeout_s} if ssl_context else {}
            self._server = await loop.create_server(self._connect, host.strip("[]"), port, **tls)
        except OSError as e:
            raise listen_error(f"{host}:{port} (transport.direct_port)", e) from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.transport.abort()
            conn.task.cancel()
        await asyncio.gather(*(c.task for c in list(self._connections)), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _connect(self) -> Connection:
        return Connection(self._serve)

    async def _serve(self, conn: Connection) -> None:
        if len(self._connections) >= MAX_CONNECTIONS:
            log.warning("direct stripes: %d connections open, the limit; one more closed", MAX_CONNECTIONS)
            conn.transport.abort()
            return
        self._connections.add(conn)
        self.accepted += 1
        try:
            bound, who = await self._hello(conn)
            conn.reply(grpc.StatusCode.OK, b"")
            while await self._stripe(conn, bound, who):
                pass
        except (ConnectionError, EOFError, asyncio.CancelledError):
            pass  # nothing to answer: the peer is gone, or the server stops
        except Exception as e:
            if isinstance(e, Refused):  # counted and worded where it was refused
                code, detail = e.code, str(e)
            else:
                code, detail = status_of(e)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("direct stripe failed", exc_info=e)
                self.metrics.error(RPC, code.name)
                detail = f"{RPC}: {detail}"
            conn.reply(code, detail.encode())
            await self._linger(conn)
        finally:
            self._connections.discard(conn)
            conn.transport.close()

    async def _linger(self, conn: Connection) -> None:
        """After an error reply, drop what the peer still sends for up to LINGER_S: closing a socket with
        unread bytes makes the kernel reset the connection, which can take the reply with it."""
        scratch = bytearray(SPILL_BYTES)
        with contextlib.suppress(Exception):
            if conn.transport.can_write_eof():
                conn.transport.write_eof()
            async with asyncio.timeout(LINGER_S):
                while True:
                    await conn.read_into(scratch)

    async def _read(self, conn: Connection, view, what: str, idle_s: float | None = None) -> None:
        idle_s = idle_s or self.config.stream_idle_timeout_s
        try:
            async with asyncio.timeout(idle_s):
                await conn.read_into(view)
        except TimeoutError:
            raise StripeTimeout(f"no {what} within {idle_s:g} s (stream_idle_timeout_s)") from None

    async def _hello(self, conn: Connection) -> tuple[str | None, str]:
        head = bytearray(HELLO.size)
        await self._read(conn, head, "hello")
        magic, version, n = HELLO.unpack(head)
        if magic != MAGIC:
            raise MessageError("not a direct stripe connection (its first bytes are not the hello)")
        if version != VERSION:
            raise Rejected(f"direct stripes version {version}; this syncer speaks {VERSION}",
                           grpc.StatusCode.FAILED_PRECONDITION)
        if n > MAX_HELLO_BYTES:
            raise MessageError(f"hello of {n} bytes, limit {MAX_HELLO_BYTES}")
        body = bytearray(n)
        await self._read(conn, body, "hello")
        try:
            hello = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MessageError(f"hello: not JSON ({e})") from None
        if not isinstance(hello, dict) or set(hello) != {"sender", "token"}:
            raise MessageError("hello: must be an object with exactly sender and token")
        sender, token = hello["sender"], hello["token"]
        if not isinstance(sender, str) or not 1 <= len(sender) <= MAX_NAME_CHARS:
            raise MessageError(f"hello: sender must be a string of 1-{MAX_NAME_CHARS} characters")
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise MessageError(f"hello: token must be a string of at most {MAX_TOKEN_CHARS} characters")
        common_name = peer_common_name(conn.transport.get_extra_info("ssl_object"))
        caller = _Caller(sender, token, common_name, conn.transport.get_extra_info("peername"))
        bound = await self.callers.auth(caller, RPC)
        return bound, bound or sender

    async def _stripe(self, conn: Connection, bound: str | None, who: str) -> bool:
        """One stripe: its header, its bytes into the upload's buffer, the upload's reply. False at a clean
        end of the connection (the peer closed it between stripes)."""
        size = bytearray(LENGTH.size)
        try:
            await self._read(conn, size, "stripe", IDLE_CONNECTION_S)
        except EOFError:
            return False
        (n,) = LENGTH.unpack(size)
        if not 1 <= n <= MAX_HEADER_BYTES:
            raise MessageError(f"stripe header of {n} bytes, limit {MAX_HEADER_BYTES}")
        head = bytearray(n)
        await self._read(conn, head, "stripe header")
        st, asm = await self.assembler.open_stripe(head, bound, who)
        if asm.failed:  # another of its stripes failed it while this one waited: that failure is the answer
            await asm.result
        loop, idle_s = asyncio.get_running_loop(), self.config.stream_idle_timeout_s
        asm.writers += 1
        writing = [True]

        def let_go() -> None:  # once: the buffer may go back to the pool (stripes.py waits for its writers)
            if writing[0]:
                writing[0] = False
                self.assembler.write_done(asm)

        view, digest, hashed = memoryview(asm.buf)[st.offset : st.offset + st.length], xxhash.xxh3_64(), [0]

        def progress() -> None:
            asm.progress_at = loop.time()
            quiet.reschedule(asm.progress_at + idle_s)
            if asm.failed and writing[0]:  # another stripe failed it: drain the rest of this one elsewhere
                conn.divert()
                let_go()
            elif writing[0]:  # hashed as each read lands, while its bytes are still in cache
                digest.update(view[hashed[0] : conn.got])
                hashed[0] = conn.got

        try:
            try:
                async with asyncio.timeout(idle_s) as quiet:
                    await conn.read_into(view, progress)
            except TimeoutError:
                raise StripeTimeout(f"no data for {idle_s:g} s (stream_idle_timeout_s) in stripe {st.index} "
                                    f"of upload {st.upload}; upload aborted") from None
            digest = None if asm.failed else digest.intdigest()
        except BaseException as e:
            conn.divert()
            view.release()
            let_go()
            if isinstance(e, (ConnectionError, EOFError)):  # ours; the other stripes' answer is the upload's
                e = MessageError(f"stripe {st.index} of upload {st.upload}: its connection closed mid-stripe")
            self.assembler.fail(asm, e)
            raise
        view.release()
        let_go()
        try:
            if digest is not None:
                await self.assembler.close_stripe(st, asm, st.length, digest, bound, RPC)
            ack = await asm.result
        except BaseException as e:
            self.assembler.fail(asm, e)
            raise
        conn.reply(grpc.StatusCode.OK, ack)
        return True
