"""Split encoded messages into gRPC messages and put them back together.

A message travels as a stream of gRPC messages ("chunks") that are plain byte
slices of its encoding, cut where it avoids copies: the prelude + header, then
the payload (the application's own ``bytes`` object when it fits in
``chunk_bytes``, else slices of it), then the 8-byte checksum trailer. Small
messages go as one chunk. The receiver learns all lengths from the 20-byte
prelude, refuses anything over its cap before buffering it, hashes bytes as they
arrive, and keeps a payload that arrived as one chunk without copying it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import xxhash

from .messages import (
    PRELUDE_BYTES, TRAILER, TRAILER_BYTES, Message, OversizedError, Payload, decode_parts, encode_parts,
    parse_prelude,
)
from .stripes import Stripe, cut

SMALL_MESSAGE_BYTES = 64 * 1024  # below this, one joined chunk beats three gRPC messages


def encode_chunks(msg: Message, chunk_bytes: int) -> Iterator[bytes]:
    """Yield ``msg`` encoded as bytes objects of at most ``chunk_bytes``."""
    head, payload = encode_parts(msg)
    return iter_chunks(head, payload, chunk_bytes)


def iter_chunks(head: bytes, payload: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """Chunks of a message from ``encode_parts``, produced and hashed lazily so
    the sender's work on chunk k+1 overlaps the sending of chunk k."""
    if chunk_bytes < PRELUDE_BYTES + TRAILER_BYTES:
        raise ValueError(f"chunk_bytes must be >= {PRELUDE_BYTES + TRAILER_BYTES}, got {chunk_bytes}")
    digest = xxhash.xxh3_64(head)
    if len(head) + len(payload) + TRAILER_BYTES <= min(chunk_bytes, SMALL_MESSAGE_BYTES):
        digest.update(payload)
        yield b"".join((head, payload, TRAILER.pack(digest.intdigest())))
        return
    for i in range(0, len(head), chunk_bytes):
        yield head[i : i + chunk_bytes]
    obj = payload.obj
    if isinstance(obj, bytes) and 0 < len(obj) == len(payload) <= chunk_bytes:
        digest.update(obj)
        yield obj  # the application's own bytes object, sent without a copy
    else:
        for i in range(0, len(payload), chunk_bytes):
            piece = payload[i : i + chunk_bytes]
            digest.update(piece)
            yield bytes(piece)
    yield TRAILER.pack(digest.intdigest())


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """A message encoded once, to be sent to many streams (fan-out): as chunks, or cut into stripes
    (``stripes``) for subscribers that fetch it striped. Each form is made on first use and kept, so a
    striped update is never chunked (nor hashed for its trailer) and one cut serves every subscriber.

    ``seq`` orders publications (``UpdateHub`` numbers them): the fan-out keeps
    the newest per fragment by it, since frames carry no version of their own.
    """

    message: Message
    parts: tuple[bytes, memoryview]  # encode_parts(message): validated at publication
    chunk_bytes: int
    seq: int = 0
    _made: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, msg: Message, chunk_bytes: int, seq: int = 0) -> "Prepared":
        return cls(msg, encode_parts(msg), chunk_bytes, seq)

    @property
    def chunks(self) -> tuple[bytes, ...]:
        if "chunks" not in self._made:
            self._made["chunks"] = tuple(iter_chunks(*self.parts, self.chunk_bytes))
        return self._made["chunks"]

    @property
    def body_bytes(self) -> int:
        """Bytes of the encoded message without its trailer (what stripes carry)."""
        return len(self.parts[0]) + len(self.parts[1])

    @property
    def nbytes(self) -> int:
        return self.body_bytes + TRAILER_BYTES

    def stripes(self, count: int) -> list[tuple[Stripe, tuple[bytes, ...]]]:
        """The message cut into ``count`` stripes (``stripes.cut``; upload id left empty), each with its
        bytes in gRPC messages of at most ``chunk_bytes``."""
        key = ("stripes", count)
        if key not in self._made:
            self._made[key] = [(st, tuple(bytes(v[i : i + self.chunk_bytes]) for v in views
                                          for i in range(0, len(v), self.chunk_bytes)))
                               for st, views in cut(*self.parts, count, "")]
        return self._made[key]


class BufferPool:
    """Receive buffers, reused once nothing references their contents any more.

    A fresh multi-MiB buffer is mmap'ed and page-faulted on first write, which
    here costs 7x the copy itself (32 MiB: 15 ms fresh vs 2.2 ms reused), so
    reassembly reuses a few buffers. A buffer is free again when no memoryview of
    it is alive (a bytearray with live exports refuses to resize), i.e. when the
    application dropped the payload views of the message decoded into it.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._buffers: list[bytearray] = []

    @staticmethod
    def _unused(buf: bytearray) -> bool:
        try:
            buf.append(0)
        except BufferError:
            return False
        del buf[-1]
        return True

    def take(self, size: int) -> bytearray | None:
        """A kept buffer of at least ``size`` bytes (at most twice that) that nothing uses, else None."""
        for i, buf in enumerate(self._buffers):
            if size <= len(buf) <= 2 * size and self._unused(buf):
                return self._buffers.pop(i)
        return None

    def get(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (at most twice that), not shared."""
        buf = self.take(size)
        return buf if buf is not None else bytearray(size)

    def put(self, buf: bytearray) -> None:
        """Offer ``buf`` back; it is handed out again only once its views are gone."""
        self._buffers.append(buf)
        if len(self._buffers) > self.keep:
            self._buffers.pop(0)


class MessageReader:
    """Turns a stream of chunks back into messages; ``feed`` returns those completed.

    Memory per stream stays below ``max_bytes``: a larger message is refused as
    soon as its prelude arrives. A payload that arrives inside one chunk is used
    in place; one spread over chunks is copied into a pooled buffer when one is
    free, else into a buffer that grows with what arrived (see ``_room``).
    """

    def __init__(self, max_bytes: int, pool: BufferPool | None = None) -> None:
        self.max_bytes = max_bytes
        self.pool = pool or BufferPool(keep=1)
        self._reset()

    def _reset(self) -> None:
        self._head = bytearray()  # prelude + header
        self._head_bytes = PRELUDE_BYTES  # grows once the prelude tells the header length
        self._payload_bytes = -1  # unknown until the prelude is in
        self._payload: memoryview | None = None
        self._buf: bytearray | None = None
        self._filled = 0
        self._tail = bytearray()
        self._digest = xxhash.xxh3_64()

    @property
    def idle(self) -> bool:
        """True when no partial message is buffered (a clean place for a stream to end)."""
        return not self._head

    def _take_head(self, view: memoryview) -> memoryview:
        take = min(self._head_bytes - len(self._head), len(view))
        self._head += view[:take]
        if self._payload_bytes < 0 and len(self._head) == PRELUDE_BYTES:
            _, hlen, plen = parse_prelude(self._head)
            total = PRELUDE_BYTES + hlen + plen + TRAILER_BYTES
            if total > self.max_bytes:
                raise OversizedError(f"oversized message: {total} bytes announced, limit {self.max_bytes}")
            self._head_bytes, self._payload_bytes = PRELUDE_BYTES + hlen, plen
        if len(self._head) == self._head_bytes:
            self._digest.update(self._head)
            if self._payload_bytes == 0:
                self._payload = memoryview(b"")
        return view[take:]

    def _take_payload(self, view: memoryview) -> memoryview:
        need = self._payload_bytes
        if self._buf is None and len(view) >= need:  # all of it in this chunk: no copy
            self._payload = view[:need]
            self._digest.update(self._payload)
            return view[need:]
        take = min(need - self._filled, len(view))
        self._room(self._filled + take)
        part = view[:take]
        self._buf[self._filled : self._filled + take] = part
        self._digest.update(part)
        self._filled += take
        if self._filled == need:
            self._payload = memoryview(self._buf)[:need]
        return view[take:]

    def _room(self, end: int) -> None:
        """Make ``self._buf`` hold at least ``end`` payload bytes.

        The prelude's length is only a claim: a peer may announce the limit and
        send one byte. So a fresh buffer never exceeds twice what has arrived
        (plus the piece in hand); growing by doubling copies each byte at most
        once more on average. A free pooled buffer costs nothing new, so the
        usual case (messages of similar sizes) still gets one at once.
        """
        need = self._payload_bytes
        if self._buf is None:
            self._buf = self.pool.take(need)
            if self._buf is not None:
                return
        elif end <= len(self._buf):
            return
        old, size = self._buf, min(need, max(end, 2 * self._filled))
        self._buf = bytearray(size)
        if old is not None and self._filled:
            self._buf[: self._filled] = memoryview(old)[: self._filled]

    def feed(self, chunk: Payload) -> list[Message]:
        out: list[Message] = []
        view = memoryview(chunk).cast("B")
        while len(view):
            if len(self._head) < self._head_bytes or self._payload_bytes < 0:
                view = self._take_head(view)
            elif self._payload is None:
                view = self._take_payload(view)
            else:
                take = min(TRAILER_BYTES - len(self._tail), len(view))
                self._tail += view[:take]
                view = view[take:]
                if len(self._tail) == TRAILER_BYTES:
                    buf = self._buf
                    try:
                        out.append(decode_parts(self._head, self._payload, self._digest.intdigest(), self._tail))
                    finally:
                        self._reset()
                        if buf is not None:
                            self.pool.put(buf)
        return out
