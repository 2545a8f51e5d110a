"""Bulk transfers resume after a broken call (wire version 4), over real loopback gRPC.

The handler drops the link (UNAVAILABLE, as a dying connection would end the call)
part-way through chosen calls; the client must continue from the first missing
byte of the same object version, and refuse to splice two versions together.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from wan_diloco.transport import BulkRequest, BulkSource, Rejected, TransportError

from .conftest import SMALL, arun, client_for, syncer

TOTAL = 640_000  # ten chunks of SMALL.chunk_bytes (64 KiB)
DATA = np.random.default_rng(7).bytes(TOTAL)


class DroppingHandler:
    """Serves bulk objects with an etag; breaks calls on request.

    ``breaks[n]`` makes call ``n`` (0-based) fail with UNAVAILABLE when its source
    reaches that byte (at a piece boundary: every byte before it was sent first).
    ``piece_bytes[n]`` cuts call ``n``'s source differently from the others, so a
    resume offset falls inside a piece and the server must slice one.
    """

    def __init__(self, data: bytes = DATA, etag: str = "v1") -> None:
        self.objects = {"state/1": (data, etag)}
        self.requests: list[BulkRequest] = []
        self.breaks: dict[int, int] = {}
        self.piece_bytes: dict[int, int] = {}
        self.on_break = None  # called as a call breaks: e.g. the object changes meanwhile

    async def bulk(self, request):
        call = len(self.requests)
        self.requests.append(request)
        data, etag = self.objects[request.name]
        pieces = self._pieces(data, self.piece_bytes.get(call, 100_000), self.breaks.get(call))
        return BulkSource(len(data), pieces, etag=etag)

    async def _pieces(self, data, size, break_at):
        for at in range(0, len(data), size):
            if break_at is not None and at >= break_at:
                if self.on_break is not None:
                    self.on_break()
                raise Rejected("connection dropped (test)", grpc.StatusCode.UNAVAILABLE)
            yield data[at : at + size]

    def seen(self) -> list[tuple[int, str]]:
        return [(r.offset, r.etag) for r in self.requests]


def request(offset: int = 0, etag: str = "", name: str = "state/1") -> BulkRequest:
    return BulkRequest("learner-2", name, {}, offset, etag)


def resumes(client) -> float:
    return client.metrics.resumes.labels("Bulk")._value.get()


def test_broken_transfer_resumes_from_the_first_missing_byte():
    async def main():
        handler = DroppingHandler()
        async with syncer(handler) as (server, _), client_for(server) as client:
            # Call 0 breaks after 200 kB (~1/3), call 1 after 450 kB, call 2 completes. Calls 1 and 2
            # cut the object into other pieces, so their resume offsets fall inside a piece.
            handler.breaks, handler.piece_bytes = {0: 200_000, 1: 450_000}, {1: 150_000, 2: 70_001}
            chunks = [c async for c in client.fetch_bulk(request())]
            assert handler.seen() == [(0, ""), (200_000, "v1"), (450_000, "v1")]
            assert resumes(client) == 2
            # Every byte exactly once, in order, offsets absolute; indices restart with each call.
            assert b"".join(bytes(c.payload) for c in chunks) == DATA
            assert [c.offset for c in chunks] == [sum(len(c.payload) for c in chunks[:i]) for i in range(len(chunks))]
            assert [c.offset for c in chunks if c.index == 0] == [0, 200_000, 450_000]
            assert {(c.total_bytes, c.etag) for c in chunks} == {(TOTAL, "v1")}
            # Only the remainder went over the wire again: payload bytes sent == the object, once.
            sent, messages = (server.metrics.bytes_out.labels("Bulk")._value.get(),
                              server.metrics.messages.labels("Bulk", "out")._value.get())
            assert messages == len(chunks)
            assert TOTAL < sent < TOTAL + 256 * messages  # headers and trailers only on top

            handler.requests, handler.breaks, handler.piece_bytes = [], {0: 300_000}, {}
            assert await client.fetch_bulk_bytes(request()) == DATA
            assert handler.seen() == [(0, ""), (300_000, "v1")] and resumes(client) == 3
    arun(main())


def test_break_before_the_first_chunk_retries_from_the_start_and_is_no_resume():
    async def main():
        handler = DroppingHandler()
        async with syncer(handler) as (server, _), client_for(server) as client:
            handler.breaks = {0: 0, 1: 200_000}
            assert await client.fetch_bulk_bytes(request()) == DATA
            assert handler.seen() == [(0, ""), (0, ""), (200_000, "v1")]
            assert resumes(client) == 1
    arun(main())


def test_object_changed_between_calls_is_an_error_not_a_splice():
    async def main():
        handler = DroppingHandler()
        new = DATA[::-1]

        def change():
            handler.objects["state/1"] = (new, "v2")
        async with syncer(handler) as (server, _), client_for(server) as client:
            handler.breaks, handler.on_break = {0: 200_000}, change
            with pytest.raises(TransportError, match="changed") as err:
                await client.fetch_bulk_bytes(request())
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "resuming at byte 200000 of 640000" in err.value.details
            assert "'v1'" in err.value.details and "'v2'" in err.value.details
            assert "from offset 0" in err.value.details
            assert handler.seen() == [(0, ""), (200_000, "v1")] and resumes(client) == 1
            # Starting over gets the new version whole.
            assert await client.fetch_bulk_bytes(request()) == new
    arun(main())


def test_object_without_etag_is_not_resumed():
    async def main():
        handler = DroppingHandler(etag="")
        async with syncer(handler) as (server, _), client_for(server) as client:
            handler.breaks = {0: 200_000}
            got = []
            with pytest.raises(TransportError, match="UNAVAILABLE.*connection dropped") as err:
                async for chunk in client.fetch_bulk(request()):
                    got.append(chunk)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert sum(len(c.payload) for c in got) == 200_000 and all(c.etag == "" for c in got)
            assert handler.seen() == [(0, "")] and resumes(client) == 0
    arun(main())


def test_requests_at_an_offset_are_checked():
    async def main():
        handler = DroppingHandler()
        handler.objects["plain"] = (DATA, "")
        async with syncer(handler) as (server, _), client_for(server) as client:
            with pytest.raises(TransportError, match=f"offset {TOTAL + 1} is past its end \\({TOTAL} bytes\\)") as err:
                await client.fetch_bulk_bytes(request(TOTAL + 1, "v1"))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(TransportError, match="changed since the transfer began.*'v0'.*'v1'") as err:
                await client.fetch_bulk_bytes(request(5, "v0"))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(TransportError, match="changed since the transfer began") as err:
                await client.fetch_bulk_bytes(request(5, ""))  # no etag at all
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(TransportError, match="'plain' is not resumable") as err:
                await client.fetch_bulk_bytes(request(5, "v1", name="plain"))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            # At offset 0 the etag is not checked: the whole object, with its current etag.
            chunks = [c async for c in client.fetch_bulk(request(0, "stale"))]
            assert b"".join(bytes(c.payload) for c in chunks) == DATA and chunks[0].etag == "v1"
            assert resumes(client) == 0
    arun(main())


def test_server_skips_exactly_offset_bytes_wherever_the_offset_falls():
    async def main():
        handler = DroppingHandler()  # pieces of 100 kB, chunks of 64 KiB
        async with syncer(handler) as (server, _), client_for(server) as client:
            chunk = SMALL.chunk_bytes
            for offset in (1, chunk - 1, chunk, chunk + 1, 99_999, 100_000, 100_001, 2 * chunk, TOTAL - 1):
                chunks = [c async for c in client.fetch_bulk(request(offset, "v1"))]
                assert b"".join(bytes(c.payload) for c in chunks) == DATA[offset:], offset
                assert [c.index for c in chunks] == list(range(len(chunks))), offset
                assert chunks[0].offset == offset and all(len(c.payload) <= chunk for c in chunks), offset
                assert {(c.total_bytes, c.etag) for c in chunks} == {(TOTAL, "v1")}, offset
    arun(main())


def test_offset_at_the_end_gets_one_empty_chunk():
    async def main():
        handler = DroppingHandler()
        handler.objects["empty"] = (b"", "e0")
        async with syncer(handler) as (server, _), client_for(server) as client:
            chunks = [c async for c in client.fetch_bulk(request(TOTAL, "v1"))]
            assert [(c.index, c.offset, c.total_bytes, bytes(c.payload), c.etag) for c in chunks] == [
                (0, TOTAL, TOTAL, b"", "v1")]
            chunks = [c async for c in client.fetch_bulk(request(name="empty"))]
            assert [(c.index, c.offset, c.total_bytes, bytes(c.payload), c.etag) for c in chunks] == [
                (0, 0, 0, b"", "e0")]
            assert await client.fetch_bulk_bytes(request(name="empty")) == b""
    arun(main())


def test_an_object_longer_than_one_calls_deadline_goes_on_in_the_next_call():
    # The call deadline is sized for max_message_bytes; a learner's whole state may be larger and
    # slower. A call that ran out of time while bytes were still arriving continues where it stopped.
    import asyncio
    import dataclasses

    class SlowHandler(DroppingHandler):
        async def bulk(self, request):  # a slow link: 0.25 s a piece for the pieces the client still needs
            self.requests.append(request)
            return BulkSource(TOTAL, self._slow(request.offset), etag="v1")

        async def _slow(self, skip):
            for at in range(0, TOTAL, 100_000):
                if at + 100_000 > skip:
                    await asyncio.sleep(0.25)
                yield DATA[at : at + 100_000]

    async def main():
        handler = SlowHandler()
        async with syncer(handler) as (server, _):
            short = dataclasses.replace(SMALL, call_timeout_s=0.6, min_upload_rate_gbit_s=1000.0)
            async with client_for(server, config=short) as client:
                assert await client.fetch_bulk_bytes(request()) == DATA
                offsets = [o for o, _ in handler.seen()]
                assert len(offsets) >= 2 and offsets == sorted(offsets) and resumes(client) == len(offsets) - 1
    arun(main())
