"""bulk_serve: a BulkSource cut into BulkChunk messages, resumed only at the same etag (no sockets)."""
import asyncio

import grpc
import pytest

from wan_diloco.transport.bulk_serve import bulk_messages
from wan_diloco.transport.handler import BulkSource, Rejected
from wan_diloco.transport.messages import BulkChunk, BulkRequest, decode_message
from wan_diloco.transport.metrics import TransportMetrics

DATA = bytes(range(256)) * 10  # 2560 bytes


def chunks(req, source, chunk_bytes=1000):
    async def collect():
        return [decode_message(m) async for m in bulk_messages("syncer", req, source, chunk_bytes, TransportMetrics())]
    return asyncio.run(collect())


def test_pieces_become_chunks_with_absolute_offsets_and_resume_skips_what_the_client_has():
    source = BulkSource(len(DATA), [DATA[:700], DATA[700:]], etag="v1")
    whole = chunks(BulkRequest("l0", "global", {}), source)
    assert all(isinstance(c, BulkChunk) and c.etag == "v1" and c.total_bytes == len(DATA) for c in whole)
    assert [c.index for c in whole] == list(range(len(whole)))
    assert b"".join(bytes(c.payload) for c in whole) == DATA
    assert max(len(c.payload) for c in whole) <= 1000
    rest = chunks(BulkRequest("l0", "global", {}, offset=1500, etag="v1"), source)
    assert rest[0].index == 0 and rest[0].offset == 1500 and b"".join(bytes(c.payload) for c in rest) == DATA[1500:]


def test_an_empty_object_still_announces_its_size_and_etag():
    (only,) = chunks(BulkRequest("l0", "empty", {}), BulkSource(0, [], etag="e"))
    assert (only.index, only.offset, only.total_bytes, bytes(only.payload), only.etag) == (0, 0, 0, b"", "e")


@pytest.mark.parametrize("source, offset, etag, code, why", [
    (BulkSource(len(DATA), [DATA]), 10, "", grpc.StatusCode.FAILED_PRECONDITION, "not resumable"),
    (BulkSource(len(DATA), [DATA], etag="v2"), 10, "v1", grpc.StatusCode.FAILED_PRECONDITION, "changed since"),
    (BulkSource(len(DATA), [DATA], etag="v1"), len(DATA) + 1, "v1", grpc.StatusCode.INVALID_ARGUMENT, "past its end"),
])
def test_a_resume_the_source_cannot_honour_is_rejected(source, offset, etag, code, why):
    with pytest.raises(Rejected, match=why) as e:
        chunks(BulkRequest("l0", "global", {}, offset=offset, etag=etag), source)
    assert e.value.code == code


@pytest.mark.parametrize("total", [len(DATA) - 1, len(DATA) + 1])
def test_a_source_whose_bytes_disagree_with_its_size_fails(total):
    with pytest.raises(RuntimeError, match="bulk source 'global' gave"):
        chunks(BulkRequest("l0", "global", {}), BulkSource(total, [DATA]))
