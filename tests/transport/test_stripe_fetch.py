"""Large updates to a learner, offered on its Subscribe stream and fetched striped (the Fetch RPC), over loopback."""
import contextlib
import dataclasses

import grpc
import numpy as np
import pytest
import xxhash

from wan_diloco.transport import Frame, MessageError, decode_message, encode_message
from wan_diloco.transport import messages as messages_mod
from wan_diloco.transport import stripes as stripes_mod
from wan_diloco.transport.messages import TRAILER_BYTES, StripeOffer, Subscribe
from wan_diloco.transport.server import SERVICE
from wan_diloco.transport.stripe_fetch import parse_fetch

from .conftest import arun, client_for, syncer
from .test_stripes import MD, STRIPED, raw_channel, until


def update(n_bytes: int = 700_001, fragment_id: int = 5) -> Frame:
    payload = np.random.default_rng(n_bytes).integers(0, 256, n_bytes, dtype=np.uint8).tobytes()
    return Frame("syncer", fragment_id, {"to_version": 3}, payload)


async def first_update(client, sender: str = "learner-0"):
    async with contextlib.aclosing(client.subscribe(sender, "us")) as updates:
        async for frame in updates:
            return frame, bytes(frame.payload)


def test_a_large_update_arrives_striped_bit_identical_and_is_never_chunked():
    frame = update()

    async def main():
        async with syncer(config=STRIPED) as (server, handler), client_for(server) as client:
            handler.hub.mailbox("learner-0")
            item = handler.hub.publish(frame)
            got, payload = await first_update(client)
            # Published only once the server saw the first call end: a stream the client has left but the server
            # has not noticed yet may take the update and write it into the dead call (at most once, see fanout.py).
            await until(lambda: not server._subscribers)
            handler.hub.publish(update(1000, fragment_id=6))  # under 2 x stripe_min_bytes: chunks, as before
            small, small_payload = await first_update(client)
            return got, payload, small, small_payload, item, server

    got, payload, small, small_payload, item, server = arun(main())
    assert payload == frame.payload and (got.sender, got.fragment, got.meta) == ("syncer", 5, {"to_version": 3})
    assert small.fragment == 6 and small_payload == update(1000, 6).payload
    assert "chunks" not in item._made and list(item._made) == [("stripes", 3)]  # one cut, no trailer hashed
    assert server.metrics.messages.labels("Fetch", "in")._value.get() == 0  # counted on the client's side
    assert not server._offers.offers


def test_each_byte_is_hashed_once_by_each_side(monkeypatch):
    """Striped both ways, the stripes' XXH3 is the only hash of the message: its bytes once by the sender
    and once by the receiver; whole-message hashing (``messages``) sees only stripe headers and Acks."""
    hashed = {"stripes": [], "messages": []}

    def counting(where):
        class Digest:
            def __init__(self, data=b""):
                self.h = xxhash.xxh3_64(data)
                hashed[where].append(len(memoryview(data).cast("B")))

            def update(self, data):
                hashed[where].append(len(memoryview(data).cast("B")))
                self.h.update(data)

            def intdigest(self):
                return self.h.intdigest()

        class Module:
            xxh3_64 = Digest

            @staticmethod
            def xxh3_64_intdigest(data):
                hashed[where].append(len(memoryview(data).cast("B")))
                return xxhash.xxh3_64_intdigest(data)
        return Module

    frame, down = update(), update(900_000)
    # wire version 5 hashed each byte twice a side: 4 x these
    up_body, down_body = (len(encode_message(f)) - TRAILER_BYTES for f in (frame, down))

    async def main():
        async with syncer(config=STRIPED) as (server, handler), client_for(server) as client:
            handler.hub.mailbox("learner-0")
            monkeypatch.setattr(stripes_mod, "xxhash", counting("stripes"))
            monkeypatch.setattr(messages_mod, "xxhash", counting("messages"))
            await client.upload_fragment(frame)
            up = {k: list(v) for k, v in hashed.items()}
            for v in hashed.values():
                v.clear()
            handler.hub.publish(down)
            _, payload = await first_update(client)
            return up, hashed, payload

    up, down_hashed, payload = arun(main())
    assert sum(up["stripes"]) == 2 * up_body and max(up["messages"]) < 1024
    assert sum(down_hashed["stripes"]) == 2 * down_body and max(down_hashed["messages"]) < 1024
    assert payload == down.payload


@pytest.mark.parametrize("meta, error", [
    ({}, "exactly upload, index, count"),
    ({"fetch": {"upload": "u", "index": 0}}, "exactly upload, index, count"),
    ({"fetch": {"upload": "a b", "index": 0, "count": 1}}, "upload must be"),
    ({"fetch": {"upload": "u", "index": True, "count": 1}}, "index must be an integer"),
    ({"fetch": {"upload": "u", "index": 0, "count": 1.0}}, "count must be an integer"),
    ({"fetch": {"upload": "u", "index": 1, "count": 1}}, "index 1 of 1"),
    ({"fetch": {"upload": "u", "index": 0, "count": 65}}, "count <= 64"),
    ({"fetch": {"upload": "u", "index": -1, "count": 2}}, "index -1 of 2"),
])
def test_malformed_fetch_requests_are_refused_naming_the_field(meta, error):
    with pytest.raises(MessageError, match=error):
        parse_fetch(meta)


async def _subscribe_raw(channel, sender: str = "learner-0"):
    """A Subscribe call made by hand, and the StripeOffer it sends first."""
    request = encode_message(Subscribe(sender, "us", "inst-1"))
    call = channel.unary_stream(f"/{SERVICE}/Subscribe")(request, timeout=10.0, metadata=MD)
    data = await call.read()
    offer = decode_message(data)
    assert isinstance(offer, StripeOffer)
    return call, offer


async def _fetch(channel, offer, index: int, count: int, upload: str | None = None):
    req = encode_message(Frame("learner-0", offer.fragment, {"fetch": {
        "upload": upload or offer.upload, "index": index, "count": count}}))
    call = channel.unary_stream(f"/{SERVICE}/Fetch")(req, timeout=10.0, metadata=MD)
    return [m async for m in call]


def test_fetches_that_do_not_fit_the_offer_are_refused_and_the_update_is_offered_again():
    async def main():
        async with syncer(config=STRIPED) as (server, handler), raw_channel(server) as channel:
            handler.hub.mailbox("learner-0")
            handler.hub.publish(update())
            call, offer = await _subscribe_raw(channel)
            errors = []
            for args in [(0, 2, "nosuchupload"), (0, 2, None), (0, 2, None)]:  # unknown; ok; the same twice
                try:
                    await _fetch(channel, offer, *args)
                except grpc.aio.AioRpcError as e:
                    errors.append((e.code(), e.details()))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            call2, offer2 = await _subscribe_raw(channel)  # the update went back to the mailbox
            call2.cancel()
            await until(lambda: not server._offers.offers)
            return errors, ended.value, offer, offer2

    errors, ended, offer, offer2 = arun(main())
    assert errors[0][0] == grpc.StatusCode.NOT_FOUND and "no update nosuchupload is offered to learner-0" in errors[0][1]
    assert errors[1][0] == grpc.StatusCode.INVALID_ARGUMENT and f"stripe 0 of update {offer.upload} fetched twice" \
        in errors[1][1]
    assert ended.code() == grpc.StatusCode.INVALID_ARGUMENT and "fetched twice" in ended.details()
    assert offer2.fragment == offer.fragment and offer2.upload != offer.upload and offer2.total == offer.total


def test_an_offer_nobody_fetches_ends_the_stream_after_the_idle_timeout():
    config = dataclasses.replace(STRIPED, stream_idle_timeout_s=0.5)

    async def main():
        async with syncer(config=config) as (server, handler), raw_channel(server) as channel:
            handler.hub.mailbox("learner-0")
            handler.hub.publish(update())
            call, offer = await _subscribe_raw(channel)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            return ended.value, offer, server

    ended, offer, server = arun(main())
    assert ended.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"update {offer.upload} (fragment 5): stripes [0] not fetched within 0.5 s" in ended.details()
    assert not server._offers.offers


def test_a_corrupted_stripe_is_refused_naming_it_and_nothing_is_yielded():
    async def main():
        async with syncer(config=STRIPED) as (server, handler), client_for(server) as client:
            handler.hub.mailbox("learner-0")
            item = handler.hub.publish(update())
            cut = item.stripes(3)  # what the server will send: flip one bit of stripe 1
            st, chunks = cut[1]
            bad = bytearray(chunks[0])
            bad[7] ^= 1
            cut[1] = (st, (bytes(bad), *chunks[1:]))
            with pytest.raises(MessageError) as refused:
                await first_update(client)
            return str(refused.value)

    text = arun(main())  # the upload id is random
    assert text.startswith("stripe 1 of upload ") and text.endswith(": checksum mismatch")


def test_a_stripe_the_client_did_not_ask_for_is_refused():
    async def main():
        async with syncer(config=STRIPED) as (server, handler), client_for(server) as client:
            handler.hub.mailbox("learner-0")
            item = handler.hub.publish(update())
            cut = item.stripes(3)
            cut[2] = cut[1]  # the server answers a fetch of stripe 2 with stripe 1
            with pytest.raises(MessageError) as refused:
                await first_update(client)
            return str(refused.value)

    text = arun(main())
    assert "fetched stripe 2 of update" in text and "the server sent stripe 1 of 3" in text


def test_a_client_that_never_stripes_fetches_one_stripe():
    frame = update()

    async def main():
        async with syncer(config=STRIPED) as (server, handler):
            async with client_for(server, config=dataclasses.replace(STRIPED, stripe_min_bytes=0)) as client:
                handler.hub.mailbox("learner-0")
                item = handler.hub.publish(frame)
                got, payload = await first_update(client)
                return payload, item

    payload, item = arun(main())
    assert payload == frame.payload and list(item._made) == [("stripes", 1)]


def test_token_is_checked_before_a_fetch_is_read():
    async def main():
        async with syncer(config=STRIPED) as (server, _), raw_channel(server) as channel:
            call = channel.unary_stream(f"/{SERVICE}/Fetch")(b"garbage", timeout=5.0,
                                                             metadata=(("authorization", "Bearer wrong-token-xx"),))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            return e.value.code()

    assert arun(main()) == grpc.StatusCode.UNAUTHENTICATED
