"""One upload striped over several calls and connections (the Stripe RPC), put back together in one buffer.

A fragment on one HTTP/2 stream rides one TCP connection, which carries at most
its socket buffer per round trip (4 MiB / 100 ms = 0.34 Gbit/s on an untuned
host) however many connections the probe opened. So a large upload is cut into
``count`` contiguous stripes of its encoded message without the trailer, one
call per stripe, each on the next connection. A stripe call sends first a small
Frame whose ``meta.stripe`` says where its bytes go (``Stripe``), then those
bytes as raw gRPC messages. The receiver writes each piece straight into one
pooled buffer at its offset (the bytes land where the message is decoded from:
no join), checks each stripe's XXH3-64, and once every stripe is in decodes the
message and hands it to the handler once. The stripes' checksums are the
message's: each byte is hashed once by the sender and once by the receiver
(wire version 5 also hashed the whole message for its trailer: two passes a
side). Every stripe call of the upload answers with that one result; any
refused stripe, or one still missing ``stream_idle_timeout_s`` after the last
byte of the upload arrived, fails the whole upload and nothing reaches the
handler. The other direction (a large update to a learner) reuses this receiver
on the client (``stripe_fetch.py``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
from typing import Awaitable, Callable, Iterator

import xxhash

from .messages import (
    PRELUDE_BYTES, Frame, MessageError, OversizedError, decode_checked_body, decode_message, encode_message,
)

MAX_STRIPES = 64
MAX_FAILED = 1024  # failed uploads remembered (their late stripes are refused)
UPLOAD_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
STRIPE_FIELDS = ("upload", "index", "count", "offset", "length", "total", "xxh3")


class StripeTimeout(Exception):
    """An upload's stripes stopped arriving for ``stream_idle_timeout_s`` (DEADLINE_EXCEEDED)."""


@dataclasses.dataclass(frozen=True)
class Stripe:
    """Bytes ``[offset, offset + length)`` of an encoded message of ``total`` bytes, stripe ``index`` of
    ``count`` of upload ``upload`` (the sender's random id of this try), and their XXH3-64."""

    upload: str
    index: int
    count: int
    offset: int
    length: int
    total: int
    xxh3: int

    def to_meta(self) -> dict:
        return {"stripe": {**{k: getattr(self, k) for k in STRIPE_FIELDS[:-1]}, "xxh3": f"{self.xxh3:016x}"}}

    @classmethod
    def parse(cls, meta: object, max_bytes: int) -> "Stripe":
        """The stripe a header Frame's meta describes; MessageError naming the field that is wrong
        (OversizedError for a total over ``max_bytes``)."""
        s = meta.get("stripe") if isinstance(meta, dict) else None
        if not isinstance(s, dict) or set(s) != set(STRIPE_FIELDS):
            raise MessageError(f"stripe header: meta.stripe must be an object with exactly {', '.join(STRIPE_FIELDS)}")
        if not isinstance(s["upload"], str) or not UPLOAD_ID.fullmatch(s["upload"]):
            raise MessageError("stripe header: upload must be 1-64 characters of [0-9A-Za-z_-]")
        if not isinstance(s["xxh3"], str) or not re.fullmatch(r"[0-9a-f]{16}", s["xxh3"]):
            raise MessageError("stripe header: xxh3 must be 16 lowercase hex digits")
        for k in STRIPE_FIELDS[1:-1]:
            if isinstance(s[k], bool) or not isinstance(s[k], int) or s[k] < 0:
                raise MessageError(f"stripe header: {k} must be an integer >= 0, got {s[k]!r:.40}")
        st = cls(s["upload"], s["index"], s["count"], s["offset"], s["length"], s["total"], int(s["xxh3"], 16))
        if not 1 <= st.count <= MAX_STRIPES or st.index >= st.count:
            raise MessageError(f"stripe header: need 0 <= index < count <= {MAX_STRIPES}, "
                               f"got index {st.index} of {st.count}")
        if st.total > max_bytes:
            raise OversizedError(f"oversized message: {st.total} bytes announced in stripes, limit {max_bytes}")
        if st.total < PRELUDE_BYTES or st.length < 1 or st.offset + st.length > st.total:
            raise MessageError(f"stripe header: bytes [{st.offset}, {st.offset + st.length}) do not fit in a "
                               f"message of {st.total}")
        return st


def stripe_count(channels: int, size: int, stripe_min_bytes: int) -> int:
    """Stripes for a message of ``size`` bytes over ``channels`` connections: one per connection while each
    gets at least ``stripe_min_bytes`` (0: never stripe); 0 or 1 means one stream."""
    return min(channels, MAX_STRIPES, size // (stripe_min_bytes or size + 1))


def cut(head: bytes, payload: memoryview, count: int, upload: str) -> list[tuple[Stripe, list[memoryview]]]:
    """The encoded message ``head + payload`` (no trailer) as ``count`` near-equal stripes, each with the
    views of ``head``/``payload`` it spans (no copy) and its checksum: one hash pass over the message."""
    parts = [memoryview(head), payload.cast("B")]
    total = sum(len(p) for p in parts)
    out = []
    for i in range(count):
        start, end = i * total // count, (i + 1) * total // count
        views, at, h = [], 0, xxhash.xxh3_64()
        for p in parts:
            lo, hi = max(start, at), min(end, at + len(p))
            if lo < hi:
                views.append(p[lo - at : hi - at])
                h.update(views[-1])
            at += len(p)
        out.append((Stripe(upload, i, count, start, end - start, total, h.intdigest()), views))
    return out


def stripe_chunks(sender: str, fragment: int, stripe: Stripe, views: list[memoryview],
                  chunk_bytes: int) -> Iterator[bytes]:
    """One stripe call's gRPC messages: the header Frame, then the stripe's bytes in ``chunk_bytes`` pieces."""
    yield encode_message(Frame(sender, fragment, stripe.to_meta()))
    for v in views:
        for i in range(0, len(v), chunk_bytes):
            yield bytes(v[i : i + chunk_bytes])


class Assembly:
    """One striped upload being received: its buffer, the stripes claimed and in, and its one result."""

    def __init__(self, key: tuple[str, str], first: Stripe) -> None:
        self.key, self.count, self.total = key, first.count, first.total
        self.claimed: dict[int, tuple[int, int]] = {}  # index -> (offset, length)
        self.done: set[int] = set()
        self.buf: bytearray | None = None
        self.opened = asyncio.get_running_loop().create_future()  # set once it holds a slot and a buffer
        self.result = asyncio.get_running_loop().create_future()  # the Ack bytes every stripe call answers
        self.progress_at = asyncio.get_running_loop().time()
        self.failed = False
        self.writers = 0  # direct stripes reading into buf right now: it goes back to the pool after them

    def claim(self, st: Stripe) -> None:
        """Reserve ``st``'s bytes; MessageError if it does not belong with the stripes already claimed."""
        if (st.count, st.total) != (self.count, self.total):
            raise MessageError(f"stripe {st.index} of upload {st.upload}: says {st.count} stripes of {st.total} "
                               f"bytes, the upload's first said {self.count} of {self.total}")
        if st.index in self.claimed:
            raise MessageError(f"stripe {st.index} of upload {st.upload} arrived twice")
        for i, (o, n) in self.claimed.items():
            if st.offset < o + n and o < st.offset + st.length:
                raise MessageError(f"stripe {st.index} of upload {st.upload} (bytes [{st.offset}, "
                                   f"{st.offset + st.length})) overlaps stripe {i} ([{o}, {o + n}))")
        self.claimed[st.index] = (st.offset, st.length)
        if len(self.claimed) == self.count and sum(n for _, n in self.claimed.values()) != self.total:
            raise MessageError(f"upload {st.upload}: its {self.count} stripes cover "
                               f"{sum(n for _, n in self.claimed.values())} of {self.total} bytes")

    def missing(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.done]


class StripeAssembler:
    """The server's striped uploads in progress (``TransportServer`` owns one).

    ``begin(who)`` takes what one upload takes (the per-sender count, a reassembly
    slot) and may raise to refuse it; ``end(who)`` gives it back. ``deliver(msg)``
    hands a complete Frame to the application and returns the Ack bytes.
    """

    def __init__(self, config, pool, begin: Callable[[str], Awaitable[None]], end: Callable[[str], None],
                 deliver: Callable[[Frame], Awaitable[bytes]], bind: Callable[[str | None, str], None],
                 metrics, rpc: str = "Stripe") -> None:
        self.config, self.pool, self.metrics, self.rpc = config, pool, metrics, rpc
        self.begin, self.end, self.deliver, self.bind = begin, end, deliver, bind
        self.uploads: dict[tuple[str, str], Assembly] = {}
        # Uploads that failed lately: a stripe of one still on its way is refused, not taken as a new upload
        # that would hold a slot until it timed out.
        self.failed: dict[tuple[str, str], None] = {}

    async def receive(self, requests, bound: str | None, who: str,
                      expect: Callable[[Stripe], None] | None = None) -> bytes:
        """One Stripe call: its header, then its bytes into the upload's buffer; the upload's Ack bytes.
        ``expect`` may refuse a header (MessageError) before anything is taken for it.

        Each gRPC message must come within ``stream_idle_timeout_s``; waiting for a reassembly slot is not
        timed (HTTP/2 flow control holds the sender back meanwhile), as for the Upload RPC."""
        idle_s, asm, nbytes = self.config.stream_idle_timeout_s, None, 0
        it = requests.__aiter__()
        try:
            try:
                head = await asyncio.wait_for(anext(it, None), idle_s)
            except TimeoutError:
                raise StripeTimeout(f"no stripe header within {idle_s:g} s (stream_idle_timeout_s)") from None
            if head is None:
                raise MessageError("stripe call ended before its header")
            st, asm = await self.open_stripe(head, bound, who, expect)
            digest, at, loop = xxhash.xxh3_64(), st.offset, asyncio.get_running_loop()
            try:
                async with asyncio.timeout(idle_s) as quiet:
                    async for chunk in it:
                        quiet.reschedule(loop.time() + idle_s)
                        if asm.failed:  # its buffer may be someone else's now
                            break
                        if at + len(chunk) > st.offset + st.length:
                            raise MessageError(f"stripe {st.index} of upload {st.upload}: more than its "
                                               f"{st.length} bytes")
                        asm.buf[at : at + len(chunk)] = chunk
                        digest.update(chunk)
                        at, nbytes = at + len(chunk), nbytes + len(chunk)
                        asm.progress_at = loop.time()
            except TimeoutError:
                raise StripeTimeout(f"no data for {idle_s:g} s (stream_idle_timeout_s) in stripe {st.index} of "
                                    f"upload {st.upload} after {nbytes} bytes; upload aborted") from None
            if not asm.failed:
                await self.close_stripe(st, asm, at - st.offset, digest.intdigest(), bound)
            return await asm.result
        except BaseException as e:
            if asm is not None:
                self.fail(asm, e)
            raise

    async def open_stripe(self, head: bytes | memoryview, bound: str | None, who: str,
                          expect: Callable[[Stripe], None] | None = None) -> tuple[Stripe, Assembly]:
        """A stripe's header message checked and its upload joined (a slot taken for its first stripe):
        the stripe and the upload whose buffer its bytes go into."""
        header = decode_message(head, max_bytes=self.config.grpc_message_bytes)
        if not isinstance(header, Frame):
            raise MessageError(f"stripe header: expected Frame, got {type(header).__name__}")
        self.bind(bound, header.sender)
        st = Stripe.parse(header.meta, self.config.max_message_bytes)
        if expect is not None:
            expect(st)
        return st, await self._join(who, st)

    async def close_stripe(self, st: Stripe, asm: Assembly, nbytes: int, digest: int, bound: str | None,
                           rpc: str | None = None) -> None:
        """Stripe ``st`` ended after ``nbytes`` of its bytes, which hash to ``digest``: checked, counted, and
        once it is the upload's last, the message decoded and delivered (``asm.result`` then holds the Ack)."""
        if nbytes != st.length:
            raise MessageError(f"stripe {st.index} of upload {st.upload}: ended after {nbytes} of {st.length} bytes")
        if digest != st.xxh3:
            raise MessageError(f"stripe {st.index} of upload {st.upload}: checksum mismatch")
        self.metrics.received(rpc or self.rpc, nbytes, 0)
        asm.done.add(st.index)
        if len(asm.done) == asm.count:
            await self._complete(asm, bound)

    async def _join(self, who: str, st: Stripe) -> Assembly:
        key = (who, st.upload)
        asm = self.uploads.get(key)
        if key in self.failed:
            raise MessageError(f"upload {st.upload} failed already (another of its stripes was refused or late)")
        if asm is None:
            asm = Assembly(key, st)
            asm.claim(st)
            self.uploads[key] = asm
            try:
                await self.begin(who)  # one striped upload counts once, whatever its stripes
            except BaseException as e:
                self.uploads.pop(key, None)
                asm.failed = True
                if not asm.opened.done():
                    asm.opened.set_exception(e if isinstance(e, Exception) else MessageError("upload refused"))
                    asm.opened.exception()  # retrieved: no "never retrieved" warning if no one else waits
                raise
            asm.buf = self.pool.get(st.total)
            asm.opened.set_result(None)
            self._watch(asm)
        else:
            try:
                asm.claim(st)
            except MessageError as e:  # a stripe that does not fit fails the whole upload
                self.fail(asm, e)
                raise
            await asyncio.shield(asm.opened)
        return asm

    def _watch(self, asm: Assembly) -> None:
        """Fail ``asm`` once nothing of it arrived for ``stream_idle_timeout_s`` (a stripe never sent)."""
        loop, idle_s = asyncio.get_running_loop(), self.config.stream_idle_timeout_s

        def check() -> None:
            if asm.result.done() or asm.failed:
                return
            left = asm.progress_at + idle_s - loop.time()
            if left > 0:
                loop.call_later(left, check)
            else:
                self.fail(asm, StripeTimeout(f"upload {asm.key[1]}: stripes {asm.missing()} of {asm.count} "
                                             f"did not arrive within {idle_s:g} s (stream_idle_timeout_s)"))
        loop.call_later(idle_s, check)

    async def _complete(self, asm: Assembly, bound: str | None) -> None:
        # Every stripe's checksum held and together they cover the message: its bytes are checked.
        msg = decode_checked_body(memoryview(asm.buf)[: asm.total], max_bytes=self.config.max_message_bytes)
        if not isinstance(msg, Frame):
            raise MessageError(f"striped upload: expected Frame, got {type(msg).__name__}")
        self.bind(bound, msg.sender)
        self.metrics.received(self.rpc, 0, 1)
        ack = await self.deliver(msg)
        del msg
        if not asm.result.done():
            asm.result.set_result(ack)
            self._release(asm)

    def fail(self, asm: Assembly, error: BaseException) -> None:
        """End ``asm`` with ``error`` (every stripe's answer; nothing is delivered), unless it has ended."""
        if asm.result.done():
            return
        asm.failed = True
        self.failed[asm.key] = None
        if len(self.failed) > MAX_FAILED:
            del self.failed[next(iter(self.failed))]
        if not isinstance(error, Exception):  # a cancelled call: the others learn why
            error = MessageError(f"upload {asm.key[1]}: a stripe call was cancelled")
        asm.result.set_exception(error)
        asm.result.exception()  # retrieved here: other stripe calls may be gone already
        self._release(asm)

    def write_done(self, asm: Assembly) -> None:
        """A direct stripe stopped writing into ``asm.buf`` (``asm.writers`` was raised for it)."""
        asm.writers -= 1
        if asm.result.done():
            self._release(asm)

    def _release(self, asm: Assembly) -> None:
        if self.uploads.get(asm.key) is asm:
            del self.uploads[asm.key]
        if asm.buf is not None and not asm.writers:  # a socket may still be reading into it: not yet
            buf, asm.buf = asm.buf, None
            self.pool.put(buf)
            self.end(asm.key[0])


async def send_striped(channels: list, first: int, method: str, frame: Frame, head: bytes, payload: memoryview,
                       count: int, chunk_bytes: int, timeout_s: float, metadata: tuple) -> bytes:
    """Upload ``frame`` (already ``encode_parts``'ed) as ``count`` Stripe calls, stripe i on channel
    ``first + i``; the syncer's Ack bytes. A failed call cancels the others (the syncer drops the upload)."""
    calls = [channels[(first + st.index) % len(channels)].stream_unary(method)(
        stripe_chunks(frame.sender, frame.fragment, st, views, chunk_bytes), timeout=timeout_s,
        metadata=metadata, wait_for_ready=True) for st, views in cut(head, payload, count, secrets.token_hex(8))]
    try:
        replies = await asyncio.gather(*calls)
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    return replies[0]
