"""Direct stripes (transport.direct_port): striped uploads over plain TLS / loopback TCP into the syncer's buffer."""
import asyncio
import dataclasses
import json
import socket

import grpc
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.runtime.launch_cluster import free_port
from wan_diloco.transport import Frame, TransportConfig, TransportError, encode_message
from wan_diloco.transport.dev_certs import make_dev_certs
from wan_diloco.transport.direct import HELLO, LENGTH, MAGIC, REPLY, VERSION
from wan_diloco.transport.security import ListenError, derive_token

from .conftest import SMALL, TOKEN, arun, client_for, syncer
from .test_stripes import fragment, stripes_of, until


def direct(config=SMALL, **kw) -> TransportConfig:
    return dataclasses.replace(config, channels=3, stripe_min_bytes=64 * 1024, direct_port=free_port(), **kw)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


def counted(server, rpc: str) -> float:
    return server.metrics.bytes_in.labels(rpc)._value.get()


def settled(server) -> bool:
    return not server._stripes.uploads and not server._uploads_by and server._slots_held == 0


@pytest.mark.parametrize("tls", [None, "server", "mutual"])
def test_direct_uploads_arrive_bit_identical_to_grpc_stripes_and_reuse_connections(certs, tls):
    server_cfg = direct(tls=certs["server_mutual" if tls == "mutual" else "server"] if tls else None)
    client_cfg = dataclasses.replace(server_cfg, tls=certs["client_mutual" if tls == "mutual" else "client"]
                                     if tls else None)
    frames = [fragment(700_001, 1), fragment(1_000_003, 2), fragment(700_001, 1)]

    async def main():
        async with syncer(config=server_cfg) as (server, handler):
            async with client_for(server, config=client_cfg) as client:
                acks = [await client.upload_fragment(f) for f in frames]
            async with client_for(server, config=dataclasses.replace(client_cfg, direct_port=0)) as client:
                await client.upload_fragment(frames[0])  # the same bytes through the Stripe RPC
            await until(lambda: settled(server))
            return acks, handler.fragments, server

    acks, got, server = arun(main())
    assert [a.global_step for a in acks] == [1, 2, 3] and all(a.detail == "merged" for a in acks)
    for (msg, data), frame in zip(got, frames + frames[:1]):
        assert data == frame.payload and (msg.sender, msg.fragment, msg.meta) == (frame.sender, frame.fragment,
                                                                                   frame.meta)
    assert server._direct.accepted == 3  # three stripes at a time, each connection kept for the next upload
    assert counted(server, "Direct") == sum(len(encode_message(f)) - 8 for f in frames)
    assert counted(server, "Stripe") == len(encode_message(frames[0])) - 8


def test_direct_upload_while_the_server_has_no_direct_listener_is_unavailable():
    async def main():
        async with syncer(config=dataclasses.replace(direct(), direct_port=0)) as (server, handler):
            async with client_for(server, config=direct(retry_budget_s=0.3)) as client:
                with pytest.raises(TransportError, match="UNAVAILABLE.*direct stripes"):
                    await client.upload_fragment(fragment())
            assert handler.fragments == [] and settled(server)
    arun(main())


@pytest.mark.parametrize("who", ["wrong-token", "another-learners-token"])
def test_direct_connections_check_credentials_before_taking_anything(who):
    cfg = direct()
    token = "another-token-123" if who == "wrong-token" else derive_token(TOKEN, "learner-1")

    async def main():
        async with syncer(config=cfg, per_sender_tokens=who != "wrong-token") as (server, handler):
            async with client_for(server, token=token) as client:
                with pytest.raises(TransportError, match="UNAUTHENTICATED"):
                    await client.upload_fragment(fragment())  # sent as learner-0
            assert handler.fragments == [] and settled(server)
            return server

    server = arun(main())
    assert server.metrics.errors.labels("Direct", "UNAUTHENTICATED")._value.get() >= 1


def test_a_client_certificate_speaks_only_for_its_own_name(certs):
    server_cfg = direct(tls=certs["server_mutual"])
    client_cfg = dataclasses.replace(server_cfg, tls=certs["client_mutual"])  # CN learner-0
    frame = dataclasses.replace(fragment(), sender="learner-1")

    async def main():
        async with syncer(config=server_cfg) as (server, handler), client_for(server, config=client_cfg) as client:
            with pytest.raises(TransportError, match="PERMISSION_DENIED.*certificate is 'learner-0'"):
                await client.upload_fragment(frame)
            assert handler.fragments == [] and settled(server)
    arun(main())


def test_direct_port_is_checked_and_a_busy_one_is_named():
    with pytest.raises(ConfigError, match="direct_port"):
        TransportConfig(direct_port=70_000).validate()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = dataclasses.replace(direct(), direct_port=s.getsockname()[1])

        async def main():
            with pytest.raises(ListenError, match="transport.direct_port.*in use"):
                async with syncer(config=cfg):
                    pass
        arun(main())


# ---- hostile or broken peers, byte by byte ------------------------------------------------------------------

def hello(sender="learner-0", token=TOKEN) -> bytes:
    body = json.dumps({"sender": sender, "token": token}).encode()
    return HELLO.pack(MAGIC, VERSION, len(body)) + body


def header(frame: Frame, st) -> bytes:
    head = encode_message(Frame(frame.sender, frame.fragment, st.to_meta()))
    return LENGTH.pack(len(head)) + head


async def replies(reader, n: int) -> list[tuple[int, bytes]]:
    """Up to ``n`` replies, fewer if the server closes the connection first."""
    out = []
    for _ in range(n):
        try:
            status, size = REPLY.unpack(await reader.readexactly(REPLY.size))
            out.append((status, await reader.readexactly(size)))
        except asyncio.IncompleteReadError:
            break
    return out


async def converse(server, data: bytes, n: int, close: bool = False):
    reader, writer = await asyncio.open_connection("127.0.0.1", server._direct.port)
    try:
        writer.write(data)
        if close:
            writer.write_eof()
        return await asyncio.wait_for(replies(reader, n), 10)
    finally:
        writer.close()


CODE = {c.name: c.value[0] for c in grpc.StatusCode}


@pytest.mark.parametrize("data, code, match", [
    (b"GET / HTTP/1.1\r\n\r\n", "INVALID_ARGUMENT", "not a direct stripe connection"),
    (HELLO.pack(MAGIC, 9, 2) + b"{}", "FAILED_PRECONDITION", "version 9"),
    (HELLO.pack(MAGIC, VERSION, 1 << 20), "INVALID_ARGUMENT", "hello of 1048576 bytes"),
    (HELLO.pack(MAGIC, VERSION, 3) + b"\xff{}", "INVALID_ARGUMENT", "hello: not JSON"),
    (HELLO.pack(MAGIC, VERSION, 2) + b"[]", "INVALID_ARGUMENT", "exactly sender and token"),
    (hello(sender=""), "INVALID_ARGUMENT", "sender must be"),
    (hello(token="x"), "UNAUTHENTICATED", "wrong bearer token"),
    (hello() + LENGTH.pack(1 << 20), "INVALID_ARGUMENT", "stripe header of 1048576 bytes"),
    (hello() + LENGTH.pack(5) + b"hello", "INVALID_ARGUMENT", ""),
    (hello() + LENGTH.pack(len(encode_message(Frame("learner-0", 1, {})))) + encode_message(Frame("learner-0", 1, {})),
     "INVALID_ARGUMENT", "meta.stripe must be"),
])
def test_malformed_hellos_and_headers_are_answered_with_the_reason_and_change_nothing(data, code, match):
    async def main():
        async with syncer(config=direct()) as (server, handler):
            got = await converse(server, data, 3)
            assert handler.fragments == [] and settled(server)
            return got

    got = arun(main())
    assert got[-1][0] == CODE[code], got
    assert match in got[-1][1].decode(), got


def test_a_stripe_with_wrong_bytes_fails_the_whole_upload_on_every_connection():
    frame = fragment()
    parts = stripes_of(frame, 3)

    async def main():
        async with syncer(config=direct()) as (server, handler):
            sends = []
            for i, (st, views) in enumerate(parts):
                body = b"".join(bytes(v) for v in views)
                if i == 1:
                    body = bytes([body[0] ^ 1]) + body[1:]
                sends.append(converse(server, hello() + header(frame, st) + body, 2))
            got = await asyncio.gather(*sends)
            await until(lambda: settled(server))
            return got, handler.fragments

    got, delivered = arun(main())
    assert delivered == []
    for answers in got:
        assert answers[0] == (0, b"")  # the hello
        assert answers[1][0] == CODE["INVALID_ARGUMENT"], answers
    assert any(b"stripe 1 of upload u1: checksum mismatch" in answers[1][1] for answers in got), got


def test_a_connection_lost_mid_stripe_fails_the_upload_and_frees_its_slot():
    frame = fragment()
    (st, views), rest = stripes_of(frame, 3)[0], stripes_of(frame, 3)[1:]

    async def main():
        async with syncer(config=direct()) as (server, handler):
            other = asyncio.ensure_future(converse(server, hello() + header(frame, rest[0][0]) +
                                                   b"".join(bytes(v) for v in rest[0][1]), 2))
            await until(lambda: server._stripes.uploads)
            half = b"".join(bytes(v) for v in views)[: st.length // 2]
            assert await converse(server, hello() + header(frame, st) + half, 2, close=True) == [(0, b"")]
            answers = await other
            await until(lambda: settled(server))
            return answers, handler.fragments

    answers, delivered = arun(main())
    assert delivered == []
    assert answers[1][0] != 0, answers  # the other stripe learns the upload failed


def test_a_stalled_stripe_times_out_and_a_missing_one_is_noticed():
    frame = fragment()
    parts = stripes_of(frame, 3)
    cfg = direct(stream_idle_timeout_s=0.5)

    async def main():
        async with syncer(config=cfg) as (server, handler):
            st, views = parts[0]
            stalled = await converse(server, hello() + header(frame, st) + b"".join(bytes(v) for v in views)[:1000], 2)
            st, views = stripes_of(frame, 3, upload="u2")[1]
            missing = await converse(server, hello() + header(frame, st) + b"".join(bytes(v) for v in views), 2)
            await until(lambda: settled(server))
            return stalled, missing, handler.fragments

    stalled, missing, delivered = arun(main())
    assert delivered == []
    assert stalled[1][0] == CODE["DEADLINE_EXCEEDED"] and b"no data for 0.5 s" in stalled[1][1]
    assert missing[1][0] == CODE["DEADLINE_EXCEEDED"] and b"did not arrive within 0.5 s" in missing[1][1]


def test_a_failed_upload_keeps_its_buffer_until_no_socket_writes_into_it():
    frame = fragment()
    st, views = stripes_of(frame, 3)[0]
    body = b"".join(bytes(v) for v in views)

    async def main():
        async with syncer(config=direct()) as (server, handler):
            reader, writer = await asyncio.open_connection("127.0.0.1", server._direct.port)
            writer.write(hello() + header(frame, st) + body[:1000])  # stripe 0 reads on
            await until(lambda: server._stripes.uploads and next(iter(server._stripes.uploads.values())).writers)
            asm = next(iter(server._stripes.uploads.values()))
            dup = await converse(server, hello() + header(frame, st), 2)  # fails the upload
            assert asm.failed and asm.buf is not None and server._slots_held == 1  # a socket still writes into it
            writer.write(body[1000:2000])  # its next read sees the failure: the rest is dropped, not written
            await until(lambda: asm.buf is None and settled(server))
            writer.write(body[2000:])
            answers = await asyncio.wait_for(replies(reader, 2), 10)
            writer.close()
            return dup, answers, handler.fragments

    dup, answers, delivered = arun(main())
    assert delivered == []
    assert dup[-1][0] == CODE["INVALID_ARGUMENT"] and b"arrived twice" in dup[-1][1], dup
    assert answers[0] == (0, b"") and answers[1][0] == CODE["INVALID_ARGUMENT"], answers
    assert b"arrived twice" in answers[1][1]  # the whole stripe drained, then the upload's answer


def test_stopping_the_server_closes_direct_connections():
    async def main():
        async with syncer(config=direct()) as (server, handler):
            reader, writer = await asyncio.open_connection("127.0.0.1", server._direct.port)
            writer.write(hello())
            assert await replies(reader, 1) == [(0, b"")]
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server's stop
        writer.close()
        assert not server._direct._connections
    arun(main())


def test_the_wire_is_as_documented_byte_for_byte():
    """docs/protocol.md's hello and reply, written by hand (big-endian lengths), not with the module's structs."""
    body = json.dumps({"sender": "learner-0", "token": TOKEN}).encode()

    async def main():
        async with syncer(config=direct()) as (server, handler):
            reader, writer = await asyncio.open_connection("127.0.0.1", server._direct.port)
            writer.write(b"WDLD" + bytes([1]) + len(body).to_bytes(4, "big") + body)
            got = await asyncio.wait_for(reader.readexactly(5), 10)
            writer.write((5).to_bytes(4, "big") + b"hello")  # a stripe header that is no message
            refused = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return got, refused

    got, refused = arun(main())
    assert got == bytes([0]) + (0).to_bytes(4, "big")  # OK, empty
    assert refused[0] == CODE["INVALID_ARGUMENT"] and int.from_bytes(refused[1:5], "big") == len(refused) - 5
