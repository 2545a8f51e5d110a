"""Split encoded messages into gRPC-message-sized chunks and put them back together.

A fragment of tens of MiB travels as a stream of chunks of ``chunk_bytes`` so that
no single gRPC message is huge (gRPC copies each message whole) and HTTP/2 flow
control paces the stream. Chunks are plain byte slices of the encoded message;
the receiver learns the total length from the 24-byte prelude, refuses anything
over its cap before buffering it, and copies each payload byte exactly once.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from .messages import PRELUDE_BYTES, Message, OversizedError, Payload, encode_parts, message_length


def encode_chunks(msg: Message, chunk_bytes: int) -> Iterator[bytes]:
    """Yield ``msg`` encoded, in bytes objects of at most ``chunk_bytes`` (one copy per byte)."""
    head, payload = encode_parts(msg)
    return iter_chunks(head, payload, chunk_bytes)


def iter_chunks(head: bytes, payload: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """Chunks of an already encoded message (see ``encode_parts``), sliced lazily."""
    if chunk_bytes < PRELUDE_BYTES:
        raise ValueError(f"chunk_bytes must be >= {PRELUDE_BYTES}, got {chunk_bytes}")
    if len(head) >= chunk_bytes:  # a huge header (big vector clock) gets chunks of its own
        for i in range(0, len(head), chunk_bytes):
            yield head[i : i + chunk_bytes]
        first = 0
    else:
        first = min(chunk_bytes - len(head), len(payload))
        yield b"".join((head, payload[:first]))
    for i in range(first, len(payload), chunk_bytes):
        yield bytes(payload[i : i + chunk_bytes])


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A message encoded once into chunks, to be sent to many streams (fan-out)."""

    message: Message
    chunks: tuple[bytes, ...]

    @classmethod
    def of(cls, msg: Message, chunk_bytes: int) -> "Prepared":
        return cls(msg, tuple(encode_chunks(msg, chunk_bytes)))

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


class Reassembler:
    """Collects chunks of a byte stream into complete encoded messages.

    ``feed`` returns the messages completed by a chunk (as bytes-like objects for
    ``decode_message``). Messages larger than ``max_bytes`` are refused as soon as
    their prelude arrives, so memory per stream stays below ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._head = bytearray()  # bytes of a prelude not yet complete
        self._buf: bytearray | None = None
        self._filled = 0

    @property
    def idle(self) -> bool:
        """True when no partial message is buffered (a clean place for a stream to end)."""
        return self._buf is None and not self._head

    def _start(self, view: memoryview) -> int:
        total = message_length(view)
        if total > self.max_bytes:
            raise OversizedError(f"oversized message: {total} bytes announced, limit {self.max_bytes}")
        return total

    def feed(self, chunk: Payload) -> list[Payload]:
        out: list[Payload] = []
        view = memoryview(chunk).cast("B")
        while len(view):
            if self._buf is None:
                if self._head or len(view) < PRELUDE_BYTES:
                    take = min(PRELUDE_BYTES - len(self._head), len(view))
                    self._head += view[:take]
                    view = view[take:]
                    if len(self._head) < PRELUDE_BYTES:
                        break
                    total = self._start(memoryview(self._head))
                    self._buf = bytearray(total)
                    self._buf[:PRELUDE_BYTES] = self._head
                    self._filled = PRELUDE_BYTES
                    self._head = bytearray()
                else:
                    total = self._start(view)
                    if len(view) >= total:  # whole message inside this chunk: no copy
                        out.append(view[:total])
                        view = view[total:]
                        continue
                    self._buf = bytearray(total)
                    self._filled = 0
            take = min(len(self._buf) - self._filled, len(view))
            self._buf[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == len(self._buf):
                out.append(self._buf)
                self._buf = None
        return out
