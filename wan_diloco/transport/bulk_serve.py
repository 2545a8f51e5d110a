"""A ``BulkSource`` served as ``BulkChunk`` messages: chunked, resumed at an offset only while its etag holds."""
from __future__ import annotations

from typing import AsyncIterator

import grpc

from .handler import BulkSource, Rejected
from .messages import BulkChunk, BulkRequest, encode_message
from .metrics import TransportMetrics


async def bulk_messages(name: str, req: BulkRequest, source: BulkSource, chunk_bytes: int,
                        metrics: TransportMetrics) -> AsyncIterator[bytes]:
    """The encoded chunks of ``source`` from ``req.offset`` on, sent by ``name``; raises ``Rejected`` for a
    resume the source cannot honour and RuntimeError when the source's bytes disagree with its size."""
    total, etag = source.total_bytes, source.etag
    if req.offset:
        check_resume(req, source)
    # offset: bytes of the source consumed (skipped or sent); index: chunks sent in this call
    index = offset = 0
    async for piece in _aiter(source.pieces):
        view = memoryview(piece).cast("B")
        if offset < req.offset:  # what a resuming client has already: dropped without a copy
            skip = min(req.offset - offset, len(view))
            view, offset = view[skip:], offset + skip
        for i in range(0, len(view), chunk_bytes):
            part = view[i : i + chunk_bytes]
            if offset + len(part) > total:
                raise RuntimeError(f"bulk source {req.name!r} gave more than {total} bytes")
            data = encode_message(BulkChunk(name, req.name, index, offset, total, part, etag))
            index, offset = index + 1, offset + len(part)
            metrics.sent("Bulk", len(data))
            yield data
    if offset != total:
        raise RuntimeError(f"bulk source {req.name!r} gave {offset} of {total} bytes")
    if index == 0:  # an empty object (or remainder) still needs one chunk to announce size and etag
        yield encode_message(BulkChunk(name, req.name, 0, offset, total, b"", etag))


def check_resume(req: BulkRequest, source: BulkSource) -> None:
    """Refuse to resume at ``req.offset`` unless the source is the version the client began with."""
    if not source.etag:
        raise Rejected(f"bulk {req.name!r} is not resumable (its source has no etag): "
                       "fetch it again from offset 0")
    if req.etag != source.etag:
        raise Rejected(f"bulk {req.name!r} changed since the transfer began (etag {req.etag[:80]!r}, "
                       f"now {source.etag[:80]!r}): fetch it again from offset 0")
    if req.offset > source.total_bytes:
        raise Rejected(f"bulk {req.name!r}: offset {req.offset} is past its end ({source.total_bytes} bytes)",
                       grpc.StatusCode.INVALID_ARGUMENT)


async def _aiter(pieces):
    if hasattr(pieces, "__aiter__"):
        async for p in pieces:
            yield p
    else:
        for p in pieces:
            yield p
