"""End to end over loopback gRPC: one server, real clients, ephemeral ports."""
import asyncio
import contextlib
import dataclasses
import errno
import json
import socket

import grpc
import pytest
import xxhash

from wan_diloco.transport import (
    BulkRequest, BulkSource, Frame, ListenError, MessageError, Subscribe, SyncerClient, TransportError,
    TransportServer, encode_message,
)
from wan_diloco.transport.messages import MESSAGE_MAGIC, PRELUDE, TRAILER, WIRE_VERSION, Kind
from wan_diloco.transport.security import bearer_metadata
from wan_diloco.transport.server import SERVICE

from .conftest import SMALL, TOKEN, RecordingHandler, arun, client_for, syncer

CLOCK = {"learner-0": 7}
META = Frame("learner-0", 0, {"step": 7, "c_steps": [1, 2], "c_tokens": [100, 200], "clock": CLOCK, "region": "us"})


def fragment(n_bytes: int, fragment_id: int = 0) -> Frame:
    meta = {"base_version": 3, "c_steps": 24, "c_tokens": 4096, "clock": CLOCK}
    return Frame("learner-0", fragment_id, meta, bytes(range(251)) * (n_bytes // 251))


def update(fragment_id: int, version: int, payload: bytes) -> Frame:
    return Frame("syncer", fragment_id, {"to_version": version, "clock": {"syncer": version}}, payload)


def test_metadata_and_multi_chunk_upload_over_several_channels():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            ack = await client.send_metadata(META)
            assert ack.global_step == 1 and handler.metadata == [META]
            sent = [fragment(300_000, i) for i in range(4)]  # ~5 chunks each
            acks = await asyncio.gather(*(client.upload_fragment(f) for f in sent))
            assert sorted(a.global_step for a in acks) == [1, 2, 3, 4]
            got = {m.fragment: (m, data) for m, data in handler.fragments}
            for f in sent:
                m, data = got[f.fragment]
                assert data == f.payload and dataclasses.replace(m, payload=b"") == dataclasses.replace(f, payload=b"")
            # round robin really used both connections
            assert [c.get_state() for c in client._channels] == [grpc.ChannelConnectivity.READY] * 2
            assert server.metrics.bytes_in.labels("Upload")._value.get() >= 4 * 300_000
    arun(main())


def test_widening_opens_connections_that_later_uploads_and_probes_use():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            await client.upload_fragment(fragment(1000, 0))
            assert await client.widen(4) == 2 and client.channels == 4
            assert await client.widen(3) == 0 and client.channels == 4  # never closes any
            sent = [fragment(300_000, i) for i in range(1, 5)]
            await asyncio.gather(*(client.upload_fragment(f) for f in sent))
            assert {m.fragment for m, _ in handler.fragments} == {0, 1, 2, 3, 4}
            await client.probe("learner-0", 4 << 20)  # spread over every connection
            assert [c.get_state() for c in client._channels] == [grpc.ChannelConnectivity.READY] * 4
    arun(main())


@pytest.mark.parametrize("token", ["wrong-token-xyz", None])
def test_bad_token_is_unauthenticated_and_changes_nothing(token):
    async def main():
        async with syncer() as (server, handler):
            async with contextlib.AsyncExitStack() as stack:
                if token is None:  # no authorization header at all
                    channel = await stack.enter_async_context(grpc.aio.insecure_channel(server.target))
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await channel.unary_unary(f"/{SERVICE}/Metadata")(encode_message(META), timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                else:
                    client = await stack.enter_async_context(client_for(server, token=token))
                    for call in (client.send_metadata(META), client.upload_fragment(fragment(200_000))):
                        with pytest.raises(TransportError) as err:
                            await call
                        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                        assert "bearer token" in str(err.value)
                    with pytest.raises(TransportError, match="UNAUTHENTICATED"):
                        await client.fetch_bulk_bytes(BulkRequest("learner-0", "global", {}))
                    with pytest.raises(TransportError, match="UNAUTHENTICATED"):
                        async for _ in client.subscribe("learner-0", "us"):
                            pass
            assert handler.metadata == [] and handler.fragments == [] and handler.hub.subscribers == []
            assert server.metrics.errors.labels("Metadata", "UNAUTHENTICATED")._value.get() >= 1
    arun(main())


async def raw_call(server, method, payload, streaming=False):
    async with grpc.aio.insecure_channel(server.target, options=server.config.client_options()) as channel:
        md = bearer_metadata(TOKEN)
        if streaming:
            return await channel.stream_unary(f"/{SERVICE}/{method}")(iter(payload), timeout=5, metadata=md)
        return await channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=5, metadata=md)


def forged_frame(header) -> bytes:
    """A Frame message with an arbitrary header and a valid checksum."""
    body = json.dumps(header).encode()
    head = PRELUDE.pack(MESSAGE_MAGIC, WIRE_VERSION, Kind.FRAME, 0, len(body), 0) + body
    return head + TRAILER.pack(xxhash.xxh3_64_intdigest(head))


def test_malformed_bodies_get_clear_errors_and_the_server_keeps_serving():
    good = encode_message(META)
    wrong_version = good[:4] + bytes([9]) + good[5:]
    big = encode_message(fragment(SMALL.max_message_bytes + 1000))
    cases = [
        ("Metadata", b"hello", False, grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        ("Metadata", wrong_version, False, grpc.StatusCode.INVALID_ARGUMENT, "unsupported wire version 9"),
        ("Metadata", good[:-1] + b"!", False, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        ("Metadata", encode_message(Subscribe("learner-0", "us", "i")), False, grpc.StatusCode.INVALID_ARGUMENT,
         "expected Frame, got Subscribe"),
        ("Metadata", forged_frame({"sender": "learner-0", "fragment": 0, "meta": [1]}), False,
         grpc.StatusCode.INVALID_ARGUMENT, "Frame.meta: must be a JSON object"),
        ("Metadata", forged_frame({"sender": "learner-0", "fragment": 0}), False,
         grpc.StatusCode.INVALID_ARGUMENT, "missing ['meta']"),
        ("Upload", [encode_message(BulkRequest("learner-0", "x", {}))], True, grpc.StatusCode.INVALID_ARGUMENT,
         "expected Frame, got BulkRequest"),
        ("Upload", [good, good], True, grpc.StatusCode.INVALID_ARGUMENT, "exactly one message"),
        ("Upload", [good[:30]], True, grpc.StatusCode.INVALID_ARGUMENT, "ended mid-message"),
        ("Upload", [big[:65536], big[65536:131072]], True, grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized"),
    ]

    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            for method, payload, streaming, code, text in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw_call(server, method, payload, streaming)
                assert err.value.code() == code, (text, err.value.details())
                assert text in err.value.details()
                assert (await client.send_metadata(META)).global_step == len(handler.metadata)
            assert handler.fragments == [] and len(handler.metadata) == len(cases)
            # too big for our own limits, or not a Frame: refused before anything is sent
            with pytest.raises(MessageError, match="exceeds max_message_bytes"):
                await client.upload_fragment(fragment(SMALL.max_message_bytes + 1000))
            with pytest.raises(MessageError, match="exceeds one gRPC message"):
                await client.send_metadata(fragment(SMALL.chunk_bytes + (2 << 20)))
            with pytest.raises(MessageError, match="takes a Frame"):
                await client.send_metadata(Subscribe("learner-0", "us", "i"))
            with pytest.raises(MessageError, match="Frame.meta"):
                await client.upload_fragment(Frame("learner-0", 0, {"x": float("nan")}))
            assert handler.fragments == [] and len(handler.metadata) == len(cases)
    arun(main())


def test_handler_rejection_and_failure_map_to_status_codes():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            handler.reject_fragments = True
            with pytest.raises(TransportError, match="FAILED_PRECONDITION.*stale base version 3") as err:
                await client.upload_fragment(fragment(1000))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(TransportError, match="INTERNAL.*KeyError"):
                await client.fetch_bulk_bytes(BulkRequest("learner-0", "no-such-object", {}))
            handler.reject_fragments = False
            assert (await client.upload_fragment(fragment(1000))).detail == "merged"
    arun(main())


def test_subscribe_delivers_newest_version_per_fragment_to_every_subscriber():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            hub = handler.hub
            for learner in ("learner-0", "learner-1"):
                hub.mailbox(learner)
            payload = bytes(200_000)
            hub.publish(update(0, 1, payload))
            hub.publish(update(1, 1, payload))
            hub.publish(update(0, 2, payload))  # replaces v1 of fragment 0
            for learner in ("learner-0", "learner-1"):
                got = []
                async with contextlib.aclosing(client.subscribe(learner, "us")) as updates:
                    async for u in updates:
                        assert isinstance(u, Frame) and u.sender == "syncer"
                        got.append((u.fragment, u.meta["to_version"], bytes(u.payload) == payload))
                        if len(got) == 2:
                            break
                assert got == [(1, 1, True), (0, 2, True)]
                assert hub.mailbox(learner).dropped == 1
    arun(main())


def test_new_subscription_ends_the_old_stream():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            first = client.subscribe("learner-0", "us")
            first_next = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0.3)
            async with contextlib.aclosing(client.subscribe("learner-0", "us")) as second:
                second_next = asyncio.ensure_future(second.__anext__())
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(first_next, 5)
                handler.hub.publish(update(3, 1, b"abc"))
                assert (await asyncio.wait_for(second_next, 5)).fragment == 3
    arun(main())


def test_bulk_transfer_in_order_chunks():
    async def main():
        async with syncer() as (server, handler), client_for(server) as client:
            handler.bulk_objects["global"] = data = bytes(range(256)) * 2000  # 512 kB, 9 chunks
            handler.bulk_objects["empty"] = b""
            chunks = [c async for c in client.fetch_bulk(BulkRequest("learner-0", "global", {"syncer": 3}))]
            assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) > 5
            assert all(len(c.payload) <= SMALL.chunk_bytes for c in chunks)
            assert await client.fetch_bulk_bytes(BulkRequest("learner-0", "global", {})) == data
            assert await client.fetch_bulk_bytes(BulkRequest("learner-0", "empty", {})) == b""

            async def lying_bulk(request):
                return BulkSource(10, [b"12345"])
            handler.bulk = lying_bulk
            with pytest.raises(TransportError, match="INTERNAL.*gave 5 of 10 bytes"):
                await client.fetch_bulk_bytes(BulkRequest("learner-0", "x", {}))
    arun(main())


def test_server_limits_concurrent_uploads():
    async def main():
        release, entered = asyncio.Event(), []
        handler = RecordingHandler()

        async def slow_fragment(msg):
            entered.append(msg.fragment)
            await release.wait()
            return None
        handler.on_fragment = slow_fragment
        config = dataclasses.replace(SMALL, max_concurrent_uploads=1)
        async with syncer(handler, config) as (server, _), client_for(server) as client:
            uploads = [asyncio.ensure_future(client.upload_fragment(fragment(100_000, i))) for i in range(3)]
            await asyncio.sleep(0.5)
            assert len(entered) == 1  # the others wait for a slot, held back by flow control
            release.set()
            await asyncio.gather(*uploads)
            assert sorted(entered) == [0, 1, 2]
    arun(main())


def test_client_reconnects_after_the_server_restarts():
    async def main():
        handler = RecordingHandler()
        first = TransportServer(handler, TOKEN, SMALL, "127.0.0.1:0")
        port = await first.start()
        second = TransportServer(handler, TOKEN, SMALL, f"127.0.0.1:{port}")
        try:
            async with client_for(first) as client:
                await client.send_metadata(META)
                updates = client.subscribe("learner-0", "us")
                pending = asyncio.ensure_future(updates.__anext__())
                await asyncio.sleep(0.2)
                await first.stop(0)
                call = asyncio.ensure_future(client.send_metadata(META))  # waits for the syncer
                await asyncio.sleep(0.5)
                await second.start()
                assert (await asyncio.wait_for(call, 10)).global_step == 2
                for _ in range(50):  # the subscriber comes back by itself
                    handler.hub.publish(update(5, 9, b"x"))
                    if pending.done():
                        break
                    await asyncio.sleep(0.1)
                assert (await asyncio.wait_for(pending, 5)).meta["to_version"] == 9
                await updates.aclose()
        finally:
            await first.stop(0)
            await second.stop(0)
    arun(main())


def test_unreachable_syncer_fails_with_a_deadline():
    async def main():
        server = TransportServer(RecordingHandler(), TOKEN, SMALL, "127.0.0.1:0")
        port = await server.start()
        await server.stop(0)
        config = dataclasses.replace(SMALL, call_timeout_s=0.5)
        async with SyncerClient(f"127.0.0.1:{port}", TOKEN, config) as client:
            with pytest.raises(TransportError) as err:
                await client.send_metadata(META)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    arun(main())


def test_cleartext_to_a_remote_address_is_refused():
    from wan_diloco.config import ConfigError
    with pytest.raises(ConfigError, match="cleartext is only allowed on loopback"):
        SyncerClient("10.1.2.3:7000", TOKEN)
    with pytest.raises(ConfigError, match="token"):
        SyncerClient("127.0.0.1:7000", "short")


def test_subscribe_renews_its_call_at_the_deadline_without_losing_updates():
    async def main():
        config = dataclasses.replace(SMALL, subscribe_renew_s=0.3)
        async with syncer(config=config) as (server, handler), client_for(server) as client:
            async with contextlib.aclosing(client.subscribe("learner-0", "us")) as updates:
                first = asyncio.ensure_future(updates.__anext__())
                await asyncio.sleep(1.0)  # three renewals pass
                handler.hub.publish(update(2, 4, b"abc"))
                got = await asyncio.wait_for(first, 5)
                assert (got.fragment, got.meta["to_version"]) == (2, 4)
            assert server.metrics.messages.labels("Subscribe", "in")._value.get() >= 3
    arun(main())


def test_renewals_in_the_middle_of_a_stream_of_updates_lose_none():
    """Make before break: the next call opens while the old one is read on, and the old one ends after the
    update it is sending. Cutting the old call at its deadline lost the update it had just written whole."""
    n = 120

    async def main():
        config = dataclasses.replace(SMALL, subscribe_renew_s=0.05)
        async with syncer(config=config) as (server, handler), client_for(server) as client:
            box = handler.hub.mailbox("learner-0")
            got: list[int] = []

            async def publish():
                for i in range(n):  # a fragment each: the mailbox never replaces one, so each must arrive
                    handler.hub.publish(update(i, 1, bytes([i]) * 150_000))
                    await asyncio.sleep(0.004)

            async def read():
                async with contextlib.aclosing(client.subscribe("learner-0", "us")) as updates:
                    async for frame in updates:
                        assert frame.payload == bytes([frame.fragment]) * 150_000
                        got.append(frame.fragment)
                        if set(got) == set(range(n)):
                            return

            await asyncio.gather(publish(), asyncio.wait_for(read(), 20))
            return got, box.dropped, server.metrics.messages.labels("Subscribe", "in")._value.get()

    got, dropped, calls = arun(main())
    assert set(got) == set(range(n)) and dropped == 0
    assert calls >= 5  # renewed in the middle of the stream


def test_a_port_outside_the_tcp_range_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"port 99999 is outside the valid range 0\.\.65535"):
        TransportServer(RecordingHandler(), TOKEN, SMALL, "127.0.0.1:99999")
    with pytest.raises(ValueError, match=r"port 65536 is outside"):
        SyncerClient("127.0.0.1:65536", TOKEN)


def test_a_busy_port_is_a_clear_listen_error():
    async def main():
        async with syncer() as (first, _):
            second = TransportServer(RecordingHandler(), TOKEN, SMALL, f"127.0.0.1:{first.port}")
            with pytest.raises(ListenError) as err:
                await second.start()  # gRPC's SO_REUSEPORT used to let it bind (and take half the connections)
            assert str(err.value) == f"cannot listen on 127.0.0.1:{first.port}: address already in use"
            assert isinstance(err.value, OSError) and err.value.errno == errno.EADDRINUSE
            assert second.port == 0
            async with client_for(first) as client:  # the first server is untouched
                assert (await client.send_metadata(META)).global_step == 1
        with socket.socket() as holder:  # a port held by some other program
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            with pytest.raises(ListenError, match=f"^cannot listen on 127.0.0.1:{port}: address already in use$"):
                await TransportServer(RecordingHandler(), TOKEN, SMALL, f"127.0.0.1:{port}").start()
    arun(main())
