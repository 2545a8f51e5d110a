"""The client's side of direct stripes (``direct.py``): connections opened on demand and kept for the next
upload, one stripe at a time each; failures surface as the gRPC status the Stripe RPC would give, so the
client's retries treat both alike."""
from __future__ import annotations

import asyncio
import json
import secrets
import time

import grpc

from .direct import CLIENT_IDLE_S, CODES, HELLO, LENGTH, MAGIC, REPLY, VERSION
from .messages import Frame, encode_message
from .security import call_token, client_ssl_context, split_host_port
from .stripes import cut

MAX_IDLE = 64  # connections kept for later uploads, all senders together
MAX_REPLY_BYTES = 1 << 20


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: str) -> None:
        self.reader, self.writer, self.sender, self.used_at = reader, writer, sender, time.monotonic()


class DirectLinks:
    """A ``SyncerClient``'s direct connections to one syncer (``host:port``)."""

    def __init__(self, target: str, token: str, config) -> None:
        self.host, _ = split_host_port(target)
        self.port, self.token, self.config = config.direct_port, token, config
        tls = config.tls
        self._ssl = client_ssl_context(tls) if tls is not None else None
        self._server_name = (tls.server_name or self.host.strip("[]")) if tls is not None else None
        self._idle: list[_Link] = []

    async def send(self, frame: Frame, head: bytes, payload: memoryview, count: int, timeout_s: float) -> bytes:
        """Upload ``frame`` (already ``encode_parts``'ed) as ``count`` direct stripes at once; the syncer's
        Ack bytes. Raises ``grpc.aio.AioRpcError`` (UNAVAILABLE for a lost connection)."""
        tasks = [asyncio.ensure_future(self._stripe(frame, st, views))
                 for st, views in cut(head, payload, count, secrets.token_hex(8))]
        try:
            async with asyncio.timeout(timeout_s):
                replies = await asyncio.gather(*tasks)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"direct stripes: no answer in {timeout_s:g} s")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return replies[0]

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for link in idle:
            link.writer.close()

    async def _stripe(self, frame: Frame, st, views) -> bytes:
        try:
            link = await self._take(frame.sender)
        except (OSError, EOFError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"direct stripes: no connection ({e!r:.200})") from None
        done = False
        try:
            header = encode_message(Frame(frame.sender, frame.fragment, st.to_meta()))
            link.writer.write(LENGTH.pack(len(header)) + header)
            step = self.config.chunk_bytes
            for v in views:
                for i in range(0, len(v), step):
                    link.writer.write(v[i : i + step])
                    await link.writer.drain()
            reply = await self._reply(link)
            done = True
            return reply
        except (OSError, EOFError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"direct stripes: connection lost ({e!r:.200})") from None
        finally:
            if done and len(self._idle) < MAX_IDLE:
                link.used_at = time.monotonic()
                self._idle.append(link)
            else:
                link.writer.close()

    async def _take(self, sender: str) -> _Link:
        now = time.monotonic()
        for link in list(self._idle):
            if now - link.used_at > CLIENT_IDLE_S or link.writer.is_closing():
                self._idle.remove(link)
                link.writer.close()
        for link in reversed(self._idle):
            if link.sender == sender:
                self._idle.remove(link)
                return link
        reader, writer = await asyncio.open_connection(self.host.strip("[]"), self.port, ssl=self._ssl,
                                                       server_hostname=self._server_name,
                                                       limit=MAX_REPLY_BYTES + REPLY.size)
        writer.transport.set_write_buffer_limits(high=4 * self.config.chunk_bytes)
        link = _Link(reader, writer, sender)
        try:
            hello = json.dumps({"sender": sender, "token": call_token(self.token, sender)}).encode()
            writer.write(HELLO.pack(MAGIC, VERSION, len(hello)) + hello)
            await self._reply(link)
        except BaseException:
            writer.close()
            raise
        return link

    async def _reply(self, link: _Link) -> bytes:
        status, n = REPLY.unpack(await link.reader.readexactly(REPLY.size))
        if n > MAX_REPLY_BYTES:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"direct stripes: a reply of {n} bytes")
        data = await link.reader.readexactly(n)
        if status:
            code = CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise rpc_error(code, data.decode("utf-8", "replace"))
        return data
