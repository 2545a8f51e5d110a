import pytest
from hypothesis import given, settings, strategies as st

from wan_diloco.transport.framing import MessageReader, Prepared, encode_chunks
from wan_diloco.transport.messages import Frame, MessageError, OversizedError, encode_message

MSG = Frame("learner-0", 1, {"base_version": 2, "clock": {"learner-0": 3}}, bytes(range(256)) * 40)


@pytest.mark.parametrize("chunk_bytes", [28, 100, 1000, 10_239, 10_240, 10_244, 1 << 20])
def test_chunks_concatenate_to_the_encoding(chunk_bytes):
    chunks = list(encode_chunks(MSG, chunk_bytes))
    assert all(isinstance(c, bytes) and 0 < len(c) <= chunk_bytes for c in chunks)
    assert b"".join(chunks) == encode_message(MSG)


def test_prepared_encodes_once():
    update = Frame("syncer", 1, {"to_version": 2}, b"p" * 5000)
    prepared = Prepared.of(update, 1024, seq=7)
    assert prepared.seq == 7 and prepared.message is update
    assert prepared.nbytes == len(encode_message(update))
    assert b"".join(prepared.chunks) == encode_message(update)
    assert max(map(len, prepared.chunks)) <= 1024


def test_one_chunk_one_message_is_not_copied():
    data = encode_message(MSG)
    (out,) = MessageReader(1 << 20).feed(data)
    assert out == MSG and out.payload.obj is data


def test_large_bytes_payload_travels_as_its_own_chunk_both_ways():
    payload = bytes(200_000)
    msg = Frame("a", 1, {}, payload)
    chunks = list(encode_chunks(msg, 1 << 20))
    assert len(chunks) == 3 and chunks[1] is payload  # head, payload (not copied), trailer
    reader = MessageReader(1 << 20)
    got = [m for c in chunks for m in reader.feed(c)]
    assert got == [msg] and got[0].payload.obj is payload  # nor copied on the way in


def test_corruption_in_any_chunk_is_caught_by_the_streaming_checksum():
    chunks = [bytearray(c) for c in encode_chunks(MSG, 1000)]
    chunks[5][17] ^= 0x40
    r = MessageReader(1 << 20)
    with pytest.raises(MessageError, match="checksum mismatch"):
        for c in chunks:
            r.feed(c)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.integers(1, 4))
def test_reassembles_any_split_of_a_message_stream(cuts, copies):
    stream = b"".join(encode_message(MSG) for _ in range(copies))
    r, got, pos, i = MessageReader(1 << 20), [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        got += r.feed(stream[pos : pos + step])
        pos, i = pos + step, i + 1
    assert r.idle
    assert got == [MSG] * copies


def test_refuses_oversized_as_soon_as_the_prelude_arrives():
    data = encode_message(MSG)
    r = MessageReader(max_bytes=len(data) - 1)
    with pytest.raises(OversizedError, match=f"{len(data)} bytes announced"):
        r.feed(data[:20])  # nothing beyond the prelude was buffered


def test_refuses_garbage_stream():
    with pytest.raises(MessageError, match="bad magic"):
        MessageReader(1 << 20).feed(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20)


def test_partial_message_is_not_idle():
    r = MessageReader(1 << 20)
    assert r.feed(encode_message(MSG)[:50]) == []
    assert not r.idle


def test_every_chunk_size_around_the_trailer_boundary():
    small = Frame("a", 1, {"r": "x"}, b"0123456789" * 20)
    encoded = encode_message(small)
    for chunk_bytes in range(28, len(encoded) + 8):
        chunks = list(encode_chunks(small, chunk_bytes))
        assert b"".join(chunks) == encoded and max(map(len, chunks)) <= chunk_bytes, chunk_bytes
        got = [m for c in chunks for m in MessageReader(1 << 20).feed(c)] if len(chunks) == 1 else None
        assert got in (None, [small])


def test_buffers_are_reused_only_after_the_payload_views_are_gone():
    from wan_diloco.transport.framing import BufferPool
    pool = BufferPool(keep=2)
    chunks = list(encode_chunks(MSG, 1000))

    def receive():
        reader = MessageReader(1 << 20, pool)
        (msg,) = [m for c in chunks for m in reader.feed(c)]
        return msg

    first = receive()
    held = first.payload.obj
    second = receive()
    assert second.payload.obj is not held  # the first message still uses its buffer
    assert bytes(first.payload) == bytes(second.payload) == MSG.payload
    del first
    third = receive()
    assert third.payload.obj is held and third == MSG


def test_an_announced_payload_is_allocated_as_it_arrives_not_up_front():
    import json
    import tracemalloc

    import xxhash

    from wan_diloco.transport.messages import MESSAGE_MAGIC, PRELUDE, TRAILER, WIRE_VERSION, Kind

    body = json.dumps({"sender": "x", "fragment": 0, "meta": {}}).encode()
    announced = 500 << 20
    head = PRELUDE.pack(MESSAGE_MAGIC, WIRE_VERSION, Kind.FRAME, 0, len(body), announced) + body
    reader = MessageReader(max_bytes=1 << 30)
    tracemalloc.start()
    try:
        assert reader.feed(head + b"x") == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # was 500 MiB for one byte
    assert len(reader._buf) == 1
    arrived, piece = 1, bytes(range(256)) * 400
    for _ in range(40):
        reader.feed(piece)
        arrived += len(piece)
        assert len(reader._buf) <= 2 * arrived + len(piece)  # at most twice what came, plus a chunk
    # and a message that does complete is intact, however its buffer grew
    payload = bytes(range(256)) * 3000
    msg = Frame("x", 0, {}, payload)
    head = PRELUDE.pack(MESSAGE_MAGIC, WIRE_VERSION, Kind.FRAME, 0, len(body), len(payload)) + body
    digest = TRAILER.pack(xxhash.xxh3_64_intdigest(head + payload))
    reader = MessageReader(max_bytes=1 << 30)
    got = [m for i in range(0, len(payload), 1000) for m in reader.feed((head if i == 0 else b"") + payload[i : i + 1000])]
    assert got == [] and reader.feed(digest) == [msg]
