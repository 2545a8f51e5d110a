"""What the application (the syncer) plugs in behind ``TransportServer``: the ``Handler`` it implements,
the ``Rejected`` error it raises to refuse a request, and the ``BulkSource`` it answers a bulk request with.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Iterable, Protocol, Union

import grpc

from .framing import Prepared
from .messages import Ack, BulkRequest, Frame, Payload, Subscribe


class Rejected(Exception):
    """Raised by a Handler to refuse a well-formed request (e.g. a stale base version)."""

    def __init__(self, detail: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION):
        super().__init__(detail)
        self.code = code


@dataclasses.dataclass(frozen=True)
class BulkSource:
    """A bulk object to stream: its exact size and its bytes in any pieces.

    ``etag`` names this version of the object and must change whenever its bytes
    do (a version number, a digest): a client whose transfer broke resumes from
    the first missing byte only while the etag is the same. Empty: not resumable,
    a broken transfer starts again from zero. The pieces are always the whole
    object; the server skips what a resuming client already has.
    """

    total_bytes: int
    pieces: Union[AsyncIterator[Payload], Iterable[Payload]]
    etag: str = ""


class Handler(Protocol):
    """What the application (the syncer) plugs in behind the server.

    Frames arrive with their payload as a read-only view of a transport buffer:
    copy what must outlive the call. Raise ``Rejected`` to refuse a well-formed
    request, ``MessageError`` for a malformed one (INVALID_ARGUMENT).
    """

    async def on_metadata(self, frame: Frame) -> Ack | None:
        """A Frame from the unary Metadata RPC (small: one gRPC message)."""

    async def on_fragment(self, frame: Frame) -> Ack | None:
        """A Frame from the Upload RPC, called once all its chunks arrived and
        decoded. May see a retry of an upload whose reply was lost, so it should
        be idempotent."""

    def subscribe(self, msg: Subscribe) -> AsyncIterator[Frame | Prepared]:
        """Frames to stream to ``msg.sender`` until it ends (see ``UpdateHub.stream``)."""

    async def bulk(self, request: BulkRequest) -> BulkSource:
        """The named object to stream back in chunks, whole even when ``request.offset`` > 0
        (the server checks the etag and skips the bytes before the offset)."""
