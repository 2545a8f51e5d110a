"""What a second process or a hostile token holder can tie up on the server, over loopback gRPC."""
import asyncio
import contextlib
import dataclasses
import logging

import grpc
import pytest

from wan_diloco.transport import Frame, TransportError
from wan_diloco.transport import server as server_module
from wan_diloco.transport.framing import encode_chunks
from wan_diloco.transport.security import bearer_metadata
from wan_diloco.transport.server import SENDER_HEADER, SERVICE

from .conftest import SMALL, TOKEN, RecordingHandler, arun, client_for, syncer


def fragment(fragment_id: int = 0, sender: str = "learner-0", n_bytes: int = 200_000) -> Frame:
    return Frame(sender, fragment_id, {"base_version": 1}, bytes(range(250)) * (n_bytes // 250))


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


class StalledUploads:
    """Upload calls on one raw connection that send their first chunk, then nothing until released."""

    def __init__(self, server, sender: str | None = None):
        self.server, self.sender = server, sender
        self.release = asyncio.Event()
        self.calls: list[asyncio.Future] = []

    async def __aenter__(self):
        self.channel = grpc.aio.insecure_channel(self.server.target, options=self.server.config.client_options())
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await asyncio.gather(*self.calls, return_exceptions=True)
        await self.channel.close()

    def start(self, timeout_s: float = 20.0) -> asyncio.Future:
        first = next(encode_chunks(fragment(n_bytes=300_000), self.server.config.chunk_bytes))

        async def chunks():
            yield first
            await self.release.wait()

        metadata = bearer_metadata(TOKEN) + (((SENDER_HEADER, self.sender),) if self.sender else ())
        call = self.channel.stream_unary(f"/{SERVICE}/Upload")(chunks(), timeout=timeout_s, metadata=metadata)
        self.calls.append(asyncio.ensure_future(call))
        return self.calls[-1]


def test_a_second_process_subscribing_as_the_same_sender_is_refused_and_the_first_keeps_its_stream():
    async def main():
        async with syncer() as (server, handler), client_for(server) as first, client_for(server) as second:
            assert first.instance != second.instance and len(first.instance) == 16
            updates = first.subscribe("learner-0", "us")
            pending = asyncio.ensure_future(updates.__anext__())
            await until(lambda: handler.hub.subscribers == ["learner-0"])
            with pytest.raises(TransportError) as err:
                async for _ in second.subscribe("learner-0", "us"):
                    pass
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert (f"learner-0 is already subscribed from another process (instance {first.instance}); "
                    "is the same --id running twice?") in str(err.value)
            assert server.metrics.errors.labels("Subscribe", "ALREADY_EXISTS")._value.get() == 1  # not retried
            await asyncio.sleep(0.2)
            assert not pending.done()  # the first learner's stream was not taken over
            handler.hub.publish(Frame("syncer", 3, {"to_version": 1}, b"abc"))
            assert (await asyncio.wait_for(pending, 5)).fragment == 3
            # The first process goes away (its connections close): a restarted one gets in.
            await updates.aclose()
            await first.close()
            for _ in range(50):
                try:
                    async with contextlib.aclosing(second.subscribe("learner-0", "us")) as again:
                        got = asyncio.ensure_future(again.__anext__())
                        await asyncio.sleep(0.2)
                        handler.hub.publish(Frame("syncer", 4, {"to_version": 2}, b"def"))
                        assert (await asyncio.wait_for(got, 5)).fragment == 4
                    break
                except TransportError as e:  # the server has not seen the old call end yet
                    assert e.code == grpc.StatusCode.ALREADY_EXISTS
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the restarted learner never got in")
    arun(main())


def test_an_idle_upload_is_aborted_and_frees_its_slot():
    config = dataclasses.replace(SMALL, max_concurrent_uploads=1, stream_idle_timeout_s=0.5)

    async def main():
        async with syncer(config=config) as (server, handler), client_for(server) as client:
            async with StalledUploads(server) as stalled:
                call = stalled.start()
                await until(lambda: server._upload_slots.locked())
                # the one slot is held by a stream that sends nothing more; a real upload still gets through
                ack = await asyncio.wait_for(client.upload_fragment(fragment(1)), 5)
                assert ack.detail == "merged"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(call, 5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no data for 0.5 s (stream_idle_timeout_s)" in err.value.details()
            assert [m.fragment for m, _ in handler.fragments] == [1]
            assert not server._upload_slots.locked()
    arun(main())


def test_one_sender_cannot_hold_more_than_its_share_of_upload_slots():
    config = dataclasses.replace(SMALL, max_uploads_per_sender=2)

    async def main():
        async with syncer(config=config) as (server, handler), client_for(server) as client:
            for sender, who in (("learner-7", "learner-7"), (None, "peer 127.0.0.1")):
                async with StalledUploads(server, sender) as stalled:
                    stalled.start(), stalled.start()
                    await until(lambda: server._uploads_by.get(who) == 2)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await asyncio.wait_for(stalled.start(), 5)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"{who} has 2 uploads open already, the limit (max_uploads_per_sender)" in \
                        err.value.details()
                    # another sender is not held up by it
                    assert (await asyncio.wait_for(client.upload_fragment(fragment(5)), 5)).detail == "merged"
                await until(lambda: who not in server._uploads_by)
            assert server._uploads_by == {}
    arun(main())


def test_the_client_names_its_uploads_and_keeps_them_within_the_per_sender_limit():
    config = dataclasses.replace(SMALL, max_inflight_uploads=8, max_uploads_per_sender=2)
    sender = "lérner 0/ü"  # metadata values are ASCII: the name travels quoted

    async def main():
        handler, release, most = RecordingHandler(), asyncio.Event(), [0]
        record = handler.on_fragment

        async def slow_fragment(msg):
            most[0] = max(most[0], server._uploads_by.get(sender, 0))
            await release.wait()
            return await record(msg)
        handler.on_fragment = slow_fragment
        async with syncer(handler, config) as (server, _), client_for(server) as client:
            uploads = [asyncio.ensure_future(client.upload_fragment(fragment(i, sender))) for i in range(6)]
            await asyncio.sleep(0.5)
            release.set()
            acks = await asyncio.wait_for(asyncio.gather(*uploads), 10)  # none refused
            assert [a.detail for a in acks] == ["merged"] * 6 and most[0] == 2
            assert {m.sender for m, _ in handler.fragments} == {sender}
    arun(main())


def test_busy_upload_slots_are_reported_once_per_episode(monkeypatch, caplog):
    monkeypatch.setattr(server_module, "SLOTS_BUSY_WARN_S", 0.2)
    config = dataclasses.replace(SMALL, max_concurrent_uploads=1)

    async def main():
        handler, release = RecordingHandler(), asyncio.Event()
        record = handler.on_fragment

        async def slow_fragment(msg):
            await release.wait()
            return await record(msg)
        handler.on_fragment = slow_fragment
        async with syncer(handler, config) as (server, _), client_for(server) as client:
            for episode in (1, 2):
                release.clear()
                uploads = [asyncio.ensure_future(client.upload_fragment(fragment(i))) for i in range(3)]
                await asyncio.sleep(1.0)  # two calls wait five times the threshold
                release.set()
                await asyncio.wait_for(asyncio.gather(*uploads), 10)
                warnings = [r for r in caplog.records if "upload slots" in r.getMessage()]
                assert len(warnings) == episode, [r.getMessage() for r in warnings]
                assert warnings[-1].levelno == logging.WARNING
                assert "all 1 upload slots (transport.max_concurrent_uploads) have been busy" in warnings[-1].getMessage()
                assert "'learner-0' x3" in warnings[-1].getMessage()
    with caplog.at_level(logging.WARNING, logger=server_module.__name__):
        arun(main())


def test_the_server_limits_concurrent_streams_per_connection():
    config = dataclasses.replace(SMALL, max_concurrent_streams=2, max_uploads_per_sender=8)

    async def main():
        async with syncer(config=config) as (server, handler):
            async with StalledUploads(server) as stalled:
                for _ in range(4):
                    stalled.start()
                await until(lambda: server._uploads_by.get("peer 127.0.0.1") == 2)
                await asyncio.sleep(0.5)
                assert server._uploads_by == {"peer 127.0.0.1": 2}  # the others wait in the client
    arun(main())


def test_a_sender_calling_faster_than_its_rate_is_refused_and_others_are_not():
    config = dataclasses.replace(SMALL, max_calls_per_s_per_sender=5.0)

    async def main():
        async with syncer(config=config) as (server, handler):
            async with client_for(server) as client:
                refused = 0
                for _ in range(30):  # a burst of 10 is let through, then about 5 a second
                    try:
                        await client.send_metadata(Frame("learner-0", 0, {}, b""))
                    except TransportError as e:
                        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_calls_per_s_per_sender" in e.details
                        refused += 1
                await client.send_metadata(Frame("learner-1", 0, {}, b""))  # another sender has its own
                await asyncio.sleep(0.5)
                await client.send_metadata(Frame("learner-0", 0, {}, b""))  # and the bucket refills
                return refused, len(handler.metadata)

    refused, served = arun(main())
    assert 15 <= refused <= 20 and served == 30 - refused + 2
