"""One upload striped over several calls and connections (the Stripe RPC), over real loopback gRPC."""
import asyncio
import contextlib
import dataclasses
import json

import grpc
import numpy as np
import pytest

from wan_diloco.transport import Frame, MessageError, OversizedError, TransportError, encode_message
from wan_diloco.transport.config import PROBE_TUNED, tune_for_link
from wan_diloco.transport.messages import TRAILER_BYTES, encode_parts
from wan_diloco.transport.security import bearer_metadata
from wan_diloco.transport.server import SENDER_HEADER, SERVICE
from wan_diloco.transport.stripes import STRIPE_FIELDS, Stripe, cut, stripe_chunks

from .conftest import SMALL, TOKEN, arun, client_for, syncer

STRIPED = dataclasses.replace(SMALL, channels=3, stripe_min_bytes=64 * 1024)
MD = bearer_metadata(TOKEN) + ((SENDER_HEADER, "learner-0"),)


def fragment(n_bytes: int = 700_001, fragment_id: int = 3) -> Frame:
    payload = np.random.default_rng(n_bytes).integers(0, 256, n_bytes, dtype=np.uint8).tobytes()
    return Frame("learner-0", fragment_id, {"base_version": 7, "clock": {"learner-0": 12}}, payload)


def stripes_of(frame: Frame, count: int, upload: str = "u1"):
    return cut(*encode_parts(frame), count, upload)


def test_cut_covers_the_encoded_message_in_order_with_each_stripes_checksum():
    import xxhash
    frame = fragment(100_003)
    whole = encode_message(frame)[:-TRAILER_BYTES]  # the stripes' checksums stand for the trailer's
    parts = stripes_of(frame, 5)
    assert b"".join(bytes(v) for _, views in parts for v in views) == whole
    for st, views in parts:
        assert whole[st.offset : st.offset + st.length] == b"".join(bytes(v) for v in views)
        assert st.xxh3 == xxhash.xxh3_64_intdigest(whole[st.offset : st.offset + st.length])
        assert (st.count, st.total) == (5, len(whole))
        assert Stripe.parse(json.loads(json.dumps(st.to_meta())), len(whole)) == st


@pytest.mark.parametrize("change, error", [
    (lambda s: s.pop("xxh3"), "exactly upload, index"),
    (lambda s: s.update(extra=1), "exactly upload, index"),
    (lambda s: s.update(upload=""), "upload must be"),
    (lambda s: s.update(upload="a/b"), "upload must be"),
    (lambda s: s.update(xxh3="12"), "xxh3 must be"),
    (lambda s: s.update(index=True), "index must be an integer"),
    (lambda s: s.update(offset=-1), "offset must be an integer"),
    (lambda s: s.update(length=1.5), "length must be an integer"),
    (lambda s: s.update(index=4, count=4), "index 4 of 4"),
    (lambda s: s.update(count=65, index=0), "count <= 64"),
    (lambda s: s.update(count=0, index=0), "count <= 64"),
    (lambda s: s.update(length=0), "do not fit"),
    (lambda s: s.update(offset=s["total"]), "do not fit"),
    (lambda s: s.update(total=10), "do not fit"),
])
def test_malformed_stripe_headers_are_refused_naming_the_field(change, error):
    st = stripes_of(fragment(10_000), 2)[1][0]
    meta = st.to_meta()
    change(meta["stripe"])
    with pytest.raises(MessageError, match=error):
        Stripe.parse(meta, 1 << 20)


def test_a_total_over_the_limit_is_oversized():
    st = stripes_of(fragment(10_000), 2)[0][0]
    with pytest.raises(OversizedError, match="oversized message"):
        Stripe.parse(st.to_meta(), st.total - 1)


def test_random_stripe_metadata_only_ever_raises_message_error():
    rng = np.random.default_rng(0)
    values = [None, True, -1, 0, 1, 7, 2**63 - 1, 1.5, "", "u1", "0" * 16, "zz", [], {}, "x" * 100]
    good = stripes_of(fragment(10_000), 4)[2][0].to_meta()["stripe"]
    for _ in range(3000):
        s = dict(good)
        for k in rng.choice(STRIPE_FIELDS, size=int(rng.integers(1, 4)), replace=False):
            s[str(k)] = values[int(rng.integers(len(values)))]
        meta = {"stripe": s} if rng.random() < 0.9 else values[int(rng.integers(len(values)))]
        try:
            st = Stripe.parse(meta, 1 << 20)
        except MessageError:
            continue
        assert 0 <= st.index < st.count <= 64 and st.offset + st.length <= st.total <= 1 << 20 and st.length > 0


def test_striped_upload_arrives_bit_identical_to_an_unstriped_one():
    frame = fragment()

    async def main():
        async with syncer(config=STRIPED) as (server, handler):
            async with client_for(server) as striped:
                ack = await striped.upload_fragment(frame)
            async with client_for(server, config=dataclasses.replace(STRIPED, stripe_min_bytes=0)) as plain:
                await plain.upload_fragment(frame)
            assert server.metrics.messages.labels("Stripe", "in")._value.get() == 1  # only the first was striped
            return ack, handler.fragments, server

    ack, got, server = arun(main())
    assert ack.detail == "merged" and ack.global_step == 1
    (a, a_bytes), (b, b_bytes) = got
    assert a_bytes == b_bytes == frame.payload
    assert (a.sender, a.fragment, a.meta) == (b.sender, b.fragment, b.meta) == (frame.sender, frame.fragment, frame.meta)
    assert not server._stripes.uploads and not server._uploads_by


@contextlib.asynccontextmanager
async def raw_channel(server):
    channel = grpc.aio.insecure_channel(server.target, options=server.config.client_options())
    try:
        yield channel
    finally:
        await channel.close()


def send(channel, frame: Frame, st: Stripe, views, body: bytes | None = None, timeout_s: float = 10.0):
    """One Stripe call; ``body`` replaces the stripe's bytes (to send wrong ones)."""
    chunks = (stripe_chunks(frame.sender, frame.fragment, st, views, 50_000) if body is None else
              iter([encode_message(Frame(frame.sender, frame.fragment, st.to_meta())), body]))
    return asyncio.ensure_future(channel.stream_unary(f"/{SERVICE}/Stripe")(chunks, timeout=timeout_s, metadata=MD))


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def test_stripes_arriving_out_of_order_are_put_back_in_order():
    frame = fragment()

    async def main():
        async with syncer(config=STRIPED) as (server, handler), raw_channel(server) as channel:
            parts = stripes_of(frame, 3)
            calls = []
            for i in (2, 0, 1):
                calls.append(send(channel, frame, *parts[i]))
                if i != 1:  # the stripe is in before the next one starts
                    await until(lambda: any(i in a.done for a in server._stripes.uploads.values()))
            replies = await asyncio.gather(*calls)
            return replies, handler.fragments, server

    replies, got, server = arun(main())
    assert len(set(replies)) == 1  # every stripe call answers with the upload's one Ack
    assert len(got) == 1 and got[0][1] == frame.payload and got[0][0].meta == frame.meta
    assert not server._stripes.uploads and not server._uploads_by and server._slots_held == 0


def _refused(sends, code, match, config=STRIPED):
    """Run raw stripe calls ``sends(channel, frame, parts)``; every one fails with ``code``, nothing is
    handed on and nothing stays held."""
    frame = fragment()

    async def main():
        async with syncer(config=config) as (server, handler), raw_channel(server) as channel:
            calls = await sends(channel, frame, stripes_of(frame, 3))
            results = await asyncio.gather(*calls, return_exceptions=True)
            await until(lambda: not server._stripes.uploads)
            return results, handler.fragments, server

    results, got, server = arun(main())
    assert got == []
    assert not server._stripes.uploads and not server._uploads_by and server._slots_held == 0
    for r in results:
        assert isinstance(r, grpc.aio.AioRpcError), r
        assert r.code() == code, (r.code(), r.details())
    assert any(match in r.details() for r in results), [r.details() for r in results]


async def _all(channel, frame, parts, change, body=None):
    calls = []
    for i, (st, views) in enumerate(parts):
        calls.append(send(channel, frame, *change(i, st, views), body=body(i, st) if body else None))
        await asyncio.sleep(0.05)
    return calls


def test_duplicate_stripe_is_refused_and_drops_the_upload():
    async def sends(channel, frame, parts):
        first = send(channel, frame, *parts[0])
        await asyncio.sleep(0.1)
        return [first, send(channel, frame, *parts[0])]
    _refused(sends, grpc.StatusCode.INVALID_ARGUMENT, "stripe 0 of upload u1 arrived twice")


def test_overlapping_stripe_is_refused():
    def change(i, st, views):
        return (dataclasses.replace(st, offset=st.offset - 10), views) if i == 1 else (st, views)

    async def sends(channel, frame, parts):
        return await _all(channel, frame, parts, change)  # stripe 2 comes after the upload failed
    _refused(sends, grpc.StatusCode.INVALID_ARGUMENT, "overlaps stripe 0")


def test_wrong_checksum_is_refused():
    async def sends(channel, frame, parts):
        st, views = parts[1]
        body = bytearray(b"".join(bytes(v) for v in views))
        body[5] ^= 1
        return [send(channel, frame, *parts[0]), send(channel, frame, st, views, body=bytes(body))]
    _refused(sends, grpc.StatusCode.INVALID_ARGUMENT, "stripe 1 of upload u1: checksum mismatch")


def test_total_over_max_message_bytes_is_refused_before_any_byte_is_buffered():
    async def sends(channel, frame, parts):
        return [send(channel, frame, *parts[0])]
    _refused(sends, grpc.StatusCode.RESOURCE_EXHAUSTED, "limit 500000",
             config=dataclasses.replace(STRIPED, max_message_bytes=500_000))


def test_stripes_that_disagree_on_count_or_cover_too_little_are_refused():
    def change(i, st, views):
        return (dataclasses.replace(st, count=4, index=3), views) if i == 2 else (st, views)

    async def sends(channel, frame, parts):
        return await _all(channel, frame, parts, change)
    _refused(sends, grpc.StatusCode.INVALID_ARGUMENT, "says 4 stripes")


@pytest.mark.parametrize("cut_bytes, extra, match", [(1, b"", "stripe 0 of upload u1: ended after"),
                                                      (0, b"x", "stripe 0 of upload u1: more than its")])
def test_short_or_long_stripe_is_refused(cut_bytes, extra, match):
    async def sends(channel, frame, parts):
        st, views = parts[0]
        body = b"".join(bytes(v) for v in views)
        return [send(channel, frame, st, views, body=body[: len(body) - cut_bytes] + extra)]
    _refused(sends, grpc.StatusCode.INVALID_ARGUMENT, match)


def test_a_stripe_that_never_comes_fails_the_upload_after_the_idle_timeout():
    async def sends(channel, frame, parts):
        return [send(channel, frame, *parts[0]), send(channel, frame, *parts[2])]
    _refused(sends, grpc.StatusCode.DEADLINE_EXCEEDED, "stripes [1] of 3 did not arrive within 0.5 s",
             config=dataclasses.replace(STRIPED, stream_idle_timeout_s=0.5))


def test_a_striped_upload_counts_once_against_the_senders_limit():
    frame = fragment()
    config = dataclasses.replace(STRIPED, max_uploads_per_sender=1, max_inflight_uploads=1)

    async def main():
        async with syncer(config=config) as (server, handler):
            async with client_for(server) as client:
                await client.upload_fragment(frame)  # 3 stripes, one upload: within a limit of 1
            async with raw_channel(server) as channel:
                parts = stripes_of(frame, 3)
                held = send(channel, frame, *parts[0])  # one upload open, waiting for its other stripes
                await until(lambda: server._uploads_by.get("learner-0") == 1)
                async with client_for(server, config=dataclasses.replace(config, stripe_min_bytes=0)) as client:
                    with pytest.raises(TransportError) as refused:
                        await client.upload_fragment(frame)
                rest = [send(channel, frame, *p) for p in parts[1:]]
                replies = await asyncio.gather(held, *rest)
            return refused.value, replies, handler.fragments, server

    refused, replies, got, server = arun(main())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_uploads_per_sender" in refused.details
    assert len(got) == 2 and all(b == frame.payload for _, b in got) and len(set(replies)) == 1
    assert not server._uploads_by and server._slots_held == 0


def test_connections_opened_after_a_probe_use_window_sizes_for_the_measured_link():
    async def main():
        async with syncer(config=STRIPED) as (server, _):
            async with client_for(server) as client:
                before = dict(client.channel_options())
                sample = await client.probe("learner-0", 1 << 20)
                after = dict(client.channel_options())
                added = await client.widen(client.channels + 1)
                await client.upload_fragment(fragment())  # the new connection carries a stripe
                return before, sample, after, added

    before, sample, after, added = arun(main())
    tuned = tune_for_link(sample.rate_gbit_s, sample.rtt_s, STRIPED)
    assert "grpc.http2.lookahead_bytes" not in before and added == 1
    assert after["grpc.http2.lookahead_bytes"] == tuned.lookahead_bytes
    assert after["grpc.http2.max_frame_size"] == tuned.max_frame_bytes
    assert after["grpc.max_receive_message_length"] == before["grpc.max_receive_message_length"]
    assert set(PROBE_TUNED) <= {f.name for f in dataclasses.fields(tuned)}


def test_a_stripe_that_stalls_mid_way_fails_the_upload_after_the_idle_timeout():
    async def sends(channel, frame, parts):
        st, views = parts[1]
        release = asyncio.Event()

        async def stalled():
            yield encode_message(Frame(frame.sender, frame.fragment, st.to_meta()))
            yield bytes(views[0][:1000])
            await release.wait()

        call = channel.stream_unary(f"/{SERVICE}/Stripe")(stalled(), timeout=10.0, metadata=MD)
        return [send(channel, frame, *parts[0]), asyncio.ensure_future(call)]
    _refused(sends, grpc.StatusCode.DEADLINE_EXCEEDED, "no data for 0.5 s (stream_idle_timeout_s) in stripe 1",
             config=dataclasses.replace(STRIPED, stream_idle_timeout_s=0.5))


def test_malformed_stripe_headers_over_the_wire_are_refused_and_the_server_goes_on():
    frame = fragment(200_000)
    rng = np.random.default_rng(1)
    values = [None, True, -1, 0, 1, 3, 2**62, 1.5, "", "u1", "0" * 16, [], {}]

    async def main():
        codes = []
        async with syncer(config=STRIPED) as (server, handler), raw_channel(server) as channel:
            st, views = stripes_of(frame, 3)[1]
            for _ in range(20):
                meta = st.to_meta()
                for k in rng.choice(STRIPE_FIELDS, size=2, replace=False):
                    meta["stripe"][str(k)] = values[int(rng.integers(len(values)))]
                chunks = [encode_message(Frame(frame.sender, frame.fragment, meta)), bytes(views[0][:100])]
                try:
                    await channel.stream_unary(f"/{SERVICE}/Stripe")(iter(chunks), timeout=5.0, metadata=MD)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            await until(lambda: not server._stripes.uploads)
            clean = not server._uploads_by and server._slots_held == 0 and handler.fragments == []
            async with client_for(server) as client:
                await client.upload_fragment(frame)
            return codes, clean, handler.fragments

    codes, clean, got = arun(main())
    # A header that happens to stay valid names a 3-stripe upload whose stripe is short: refused as well.
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert clean and len(got) == 1 and got[0][1] == frame.payload
