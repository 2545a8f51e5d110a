import pytest
from hypothesis import given, settings, strategies as st

from wan_diloco.transport.framing import Prepared, Reassembler, encode_chunks
from wan_diloco.transport.messages import (
    FragmentUpload, GlobalUpdate, MessageError, OversizedError, decode_message, encode_message,
)

MSG = FragmentUpload("learner-0", "us", 1, 2, 3, 4, {"learner-0": 3}, bytes(range(256)) * 40)


@pytest.mark.parametrize("chunk_bytes", [24, 100, 1000, 10_239, 1 << 20])
def test_chunks_concatenate_to_the_encoding(chunk_bytes):
    chunks = list(encode_chunks(MSG, chunk_bytes))
    assert all(isinstance(c, bytes) and 0 < len(c) <= chunk_bytes for c in chunks)
    assert b"".join(chunks) == encode_message(MSG)


def test_prepared_encodes_once():
    update = GlobalUpdate("syncer", 1, 2, 3, {}, b"p" * 5000)
    prepared = Prepared.of(update, 1024)
    assert prepared.nbytes == len(encode_message(update))
    assert len(prepared.chunks) == 5


def test_one_chunk_one_message_is_not_copied():
    data = encode_message(MSG)
    (out,) = Reassembler(1 << 20).feed(data)
    assert isinstance(out, memoryview) and out.obj is data


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.integers(1, 4))
def test_reassembles_any_split_of_a_message_stream(cuts, copies):
    stream = b"".join(encode_message(MSG) for _ in range(copies))
    r, got, pos, i = Reassembler(1 << 20), [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        got += r.feed(stream[pos : pos + step])
        pos, i = pos + step, i + 1
    assert r.idle
    assert [decode_message(m) for m in got] == [MSG] * copies


def test_refuses_oversized_as_soon_as_the_prelude_arrives():
    data = encode_message(MSG)
    r = Reassembler(max_bytes=len(data) - 1)
    with pytest.raises(OversizedError, match=f"{len(data)} bytes announced"):
        r.feed(data[:24])  # nothing beyond the prelude was buffered


def test_refuses_garbage_stream():
    with pytest.raises(MessageError, match="bad magic"):
        Reassembler(1 << 20).feed(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20)


def test_partial_message_is_not_idle():
    r = Reassembler(1 << 20)
    assert r.feed(encode_message(MSG)[:50]) == []
    assert not r.idle
