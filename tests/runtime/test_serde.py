"""Core messages <-> transport frames <-> bytes, and bulk fragments (no sockets)."""
import asyncio
import contextlib
import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wan_diloco import transport
from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import FragmentUpload, GlobalUpdate, Metadata, ProtocolError
from wan_diloco.fragments import Layout
from wan_diloco.runtime import serde

LAYOUT = Layout([("a", "b"), ("c",)], {"a": (2, 3), "b": (4,), "c": (5,)})
FP32 = FragmentCodec(CodecConfig(bits=32), LAYOUT)
INT8 = FragmentCodec(CodecConfig(bits=8, block_size=16), LAYOUT)
BULK = FragmentCodec(CodecConfig(bits=32, zstd=False), LAYOUT)


def values(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.normal(size=(2, 3)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}


def wire(msg):
    """``msg`` through its frame and the transport's bytes, as a receiver gets it."""
    return transport.decode_message(bytearray(transport.encode_message(serde.to_frame(msg))))


def metadata(**kw):
    base = dict(learner=2, step=12, c_steps=(3, 0), c_tokens=(3072, 0), clock=VectorClock({"learner-2": 12}),
                step_s=0.125, sync_s=None, region="eu")
    return Metadata(**{**base, **kw})


def upload(codec=FP32, **kw):
    enc = codec.roundtrip(values(1))
    base = dict(learner=2, fragment=0, due_step=24, base_version=3, c_steps=8, c_tokens=1024,
                clock=VectorClock({"learner-2": 5, "syncer": 4}), delta=enc.values, nbytes=enc.nbytes,
                payload=enc.payload, region="eu", final=True)
    return FragmentUpload(**{**base, **kw})


def update(codec=FP32, **kw):
    enc = codec.roundtrip(values(2))
    base = dict(fragment=0, from_version=4, to_version=5, due_step=24, global_step=30,
                clock=VectorClock({"syncer": 9}), update=enc.values, nbytes=enc.nbytes, contributors=(1, 2),
                held_s={1: 0.25, 12: 1.5}, payload=enc.payload, final=False)
    return GlobalUpdate(**{**base, **kw})


def assert_same(got, want, tensors):
    """Equal field by field; the tensors bit for bit; the decoded message keeps no payload."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == tensors:
            assert list(a) == list(b)
            assert all(a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes() for n in b), f.name
        elif f.name == "payload":
            assert a is None
        else:
            assert a == b and type(a) is type(b), (f.name, a, b)


# ---- round trips ------------------------------------------------------------------------


def test_metadata_round_trip():
    m = metadata()
    frame = wire(m)
    assert (frame.sender, frame.fragment, len(frame.payload)) == ("learner-2", 0, 0)
    assert serde.metadata_from_frame(frame, 4) == m
    m2 = metadata(step_s=None, c_steps=(), c_tokens=(), region="", clock=VectorClock())
    assert serde.metadata_from_frame(wire(m2), 3) == m2


@pytest.mark.parametrize("codec", [FP32, INT8], ids=["fp32", "int8"])
def test_upload_round_trip(codec):
    up = upload(codec)
    frame = wire(up)
    assert (frame.sender, frame.fragment, bytes(frame.payload)) == ("learner-2", 0, up.payload)
    assert "delta" not in frame.meta and "nbytes" not in frame.meta and "learner" not in frame.meta
    assert_same(serde.upload_from_frame(frame, codec, 4), up, "delta")


@pytest.mark.parametrize("codec", [FP32, INT8], ids=["fp32", "int8"])
def test_update_round_trip(codec):
    g = update(codec, final=True)
    frame = wire(g)
    assert frame.sender == "syncer" and frame.meta["held_s"] == {"1": 0.25, "12": 1.5}
    got = serde.update_from_frame(frame, codec)
    assert_same(got, g, "update")
    assert got.held_s == {1: 0.25, 12: 1.5} and got.contributors == (1, 2)


def test_frames_need_a_payload_and_valid_numbers_to_be_sent():
    with pytest.raises(ProtocolError, match="FragmentUpload.payload: none to send"):
        serde.to_frame(upload(payload=None))
    with pytest.raises(ProtocolError, match="FragmentUpload.learner: expected a non-negative integer"):
        serde.to_frame(upload(learner=-1))
    with pytest.raises(ProtocolError, match="GlobalUpdate.due_step: expected a non-negative integer"):
        serde.to_frame(update(due_step=True))
    with pytest.raises(ProtocolError, match="Metadata.step_s: expected a finite number"):
        serde.to_frame(metadata(step_s=float("nan")))
    with pytest.raises(TypeError, match="to_frame takes"):
        serde.to_frame(transport.Ack("syncer"))
    # numpy scalars (counters summed in numpy) go out as plain JSON numbers
    frame = serde.to_frame(metadata(step=np.int64(5), c_tokens=(np.int64(1), 2), step_s=np.float32(0.5)))
    assert frame.meta["step"] == 5 and type(frame.meta["step"]) is int and frame.meta["step_s"] == 0.5


# ---- malformed meta ---------------------------------------------------------------------


def with_meta(frame, **changes):
    meta = {k: v for k, v in frame.meta.items() if k not in changes or changes[k] is not DROP}
    meta.update({k: v for k, v in changes.items() if v is not DROP})
    return dataclasses.replace(frame, meta=meta)


DROP = object()
BAD_UPLOAD_META = [
    ({"due_step": DROP}, r"FragmentUpload.due_step: missing"),
    ({"learner": 2}, r"FragmentUpload.learner: unknown field"),
    ({"delta": []}, r"FragmentUpload.delta: unknown field"),
    ({"base_version": "3"}, r"FragmentUpload.base_version: expected a non-negative integer, got '3'"),
    ({"base_version": True}, r"FragmentUpload.base_version: expected a non-negative integer, got True"),
    ({"c_steps": -1}, r"FragmentUpload.c_steps: expected a non-negative integer, got -1"),
    ({"c_tokens": 1.0}, r"FragmentUpload.c_tokens: expected a non-negative integer"),
    ({"final": 1}, r"FragmentUpload.final: expected true or false, got 1"),
    ({"region": None}, r"FragmentUpload.region: expected a string"),
    ({"region": "r" * 257}, r"FragmentUpload.region: expected a string of at most 256"),
    ({"clock": [1]}, r"FragmentUpload.clock: vector clock: expected a mapping"),
    ({"clock": {"learner-2": -1}}, r"FragmentUpload.clock: vector clock: entry 'learner-2'"),
    ({"clock": {"": 1}}, r"FragmentUpload.clock: vector clock: node name"),
]


@pytest.mark.parametrize("changes, match", BAD_UPLOAD_META)
def test_malformed_upload_meta_names_the_field(changes, match):
    frame = with_meta(wire(upload()), **changes)
    with pytest.raises(ProtocolError, match=match):
        serde.upload_from_frame(frame, FP32, 4)


@pytest.mark.parametrize("changes, match", [
    ({"step_s": "fast"}, r"Metadata.step_s: expected a finite number"),
    ({"sync_s": False}, r"Metadata.sync_s: expected a finite number, got False"),
    ({"step_s": DROP}, r"Metadata.step_s: missing"),
    ({"c_steps": [1, -2]}, r"Metadata.c_steps: expected a list of non-negative integers"),
    ({"c_tokens": [True]}, r"Metadata.c_tokens: expected a list of non-negative integers"),
    ({"c_tokens": {"0": 1}}, r"Metadata.c_tokens: expected a list"),
    ({"step": 1 << 63}, r"Metadata.step: expected a non-negative integer"),
    ({"extra": 1}, r"Metadata.extra: unknown field"),
])
def test_malformed_metadata_meta_names_the_field(changes, match):
    with pytest.raises(ProtocolError, match=match):
        serde.metadata_from_frame(with_meta(wire(metadata()), **changes), 4)


@pytest.mark.parametrize("changes, match", [
    ({"held_s": {"x": 1.0}}, r"GlobalUpdate.held_s: key 'x' is not a learner id"),
    ({"held_s": {"01": 1.0}}, r"GlobalUpdate.held_s: key '01' is not a learner id"),
    ({"held_s": {"-1": 1.0}}, r"GlobalUpdate.held_s: key '-1' is not a learner id"),
    ({"held_s": {"1": "slow"}}, r"GlobalUpdate.held_s: expected a finite number"),
    ({"held_s": [1]}, r"GlobalUpdate.held_s: expected an object"),
    ({"contributors": [1, "2"]}, r"GlobalUpdate.contributors: expected a list of non-negative integers"),
    ({"to_version": None}, r"GlobalUpdate.to_version: expected a non-negative integer, got None"),
    ({"final": "yes"}, r"GlobalUpdate.final: expected true or false"),
    ({"clock": DROP}, r"GlobalUpdate.clock: missing"),
])
def test_malformed_update_meta_names_the_field(changes, match):
    with pytest.raises(ProtocolError, match=match):
        serde.update_from_frame(with_meta(wire(update()), **changes), FP32)


@pytest.mark.parametrize("sender, n, match", [
    ("syncer", 4, "FragmentUpload.sender: sender 'syncer' is not a learner"),
    ("learner-4", 4, r"FragmentUpload.sender: .*learner-0..learner-3"),
    ("learner-01", 4, "is not a learner"),
    ("learner-1x", 4, "is not a learner"),
    ("learner-\u00b9", 4, "is not a learner"),  # a unicode digit: isdigit() says yes, int() says no
    ("learner--1", 4, "is not a learner"),
])
def test_sender_must_be_a_learner_of_this_run(sender, n, match):
    frame = dataclasses.replace(wire(upload()), sender=sender)
    with pytest.raises(ProtocolError, match=match):
        serde.upload_from_frame(frame, FP32, n)
    with pytest.raises(ProtocolError, match=match.replace("FragmentUpload", "Metadata")):
        serde.metadata_from_frame(dataclasses.replace(wire(metadata()), sender=sender), n)


def test_learner_id():
    assert serde.learner_id("learner-0", 1) == 0 and serde.learner_id("learner-12", 13) == 12
    for bad in ("learner-1", "", "learner-", "Learner-0", "learner-0 "):
        with pytest.raises(ProtocolError):
            serde.learner_id(bad, 1)


def test_update_must_come_from_the_syncer_and_metadata_carries_no_fragment():
    with pytest.raises(ProtocolError, match="GlobalUpdate.sender: expected 'syncer', got 'learner-0'"):
        serde.update_from_frame(dataclasses.replace(wire(update()), sender="learner-0"), FP32)
    with pytest.raises(ProtocolError, match="Metadata.fragment: must be 0"):
        serde.metadata_from_frame(dataclasses.replace(wire(metadata()), fragment=1), 4)
    with pytest.raises(ProtocolError, match="Metadata.payload: must be empty, got 3 bytes"):
        serde.metadata_from_frame(dataclasses.replace(wire(metadata()), payload=b"abc"), 4)


@pytest.mark.parametrize("change, match", [
    (dict(fragment=1), "^fragment 1: "),  # the payload encodes fragment 0
    (dict(fragment=7), "^fragment 7: "),
    (dict(payload=b"junk"), "^fragment 0: "),
    (dict(payload=b""), "^fragment 0: "),
])
def test_codec_refusal_becomes_a_protocol_error_naming_the_fragment(change, match):
    with pytest.raises(ProtocolError, match=match):
        serde.upload_from_frame(dataclasses.replace(wire(upload()), **change), FP32, 4)
    with pytest.raises(ProtocolError, match=match):
        serde.update_from_frame(dataclasses.replace(wire(update()), **change), FP32)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
FRAMES = [(lambda f: serde.metadata_from_frame(f, 4), wire(metadata())),
          (lambda f: serde.upload_from_frame(f, FP32, 4), wire(upload())),
          (lambda f: serde.update_from_frame(f, FP32), wire(update()))]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FRAMES), st.data())
def test_fuzz_any_meta_value_gives_a_message_or_a_protocol_error(case, data):
    decode, frame = case
    field = data.draw(st.sampled_from(sorted(frame.meta) + ["new"]))
    try:
        decode(with_meta(frame, **{field: data.draw(json_values)}))
    except ProtocolError:
        pass  # the only allowed failure


# ---- bulk -------------------------------------------------------------------------------


def test_bulk_fragment_round_trip_gives_owned_writable_copies():
    v = values(3)
    data = bytearray(serde.fragment_to_bulk(0, 7, 99, v, BULK, run_id="run-a", epoch=2, resumed_from=5))
    msg = transport.decode_message(data)  # one transport message: one header, one checksum
    assert isinstance(msg, transport.Frame) and msg.meta == {
        "version": 7, "global_step": 99, "run_id": "run-a", "epoch": 2, "resumed_from": 5}
    got = serde.fragment_from_bulk(data, BULK)
    p, version, step, out = got[:4]
    assert (p, version, step) == (0, 7, 99) and (got.run_id, got.epoch, got.resumed_from) == ("run-a", 2, 5)
    assert all(out[n].tobytes() == v[n].tobytes() and out[n].shape == v[n].shape for n in v)
    data[:] = bytes(len(data))  # the transport buffer is reused: the values must not change
    assert all(out[n].tobytes() == v[n].tobytes() for n in v)
    out["a"][0, 0] = 1.0  # and the learner may install them in place


def test_bulk_refuses_bad_objects():
    data = serde.fragment_to_bulk(1, 2, 3, {"c": np.arange(5, dtype=np.float32)}, BULK)
    with pytest.raises(ProtocolError, match="bulk object: checksum mismatch"):
        serde.fragment_from_bulk(data[:-1] + bytes([data[-1] ^ 1]), BULK)
    with pytest.raises(ProtocolError, match="bulk object: truncated"):
        serde.fragment_from_bulk(data[:10], BULK)
    with pytest.raises(ProtocolError, match="bulk object: expected a Frame, got Ack"):
        serde.fragment_from_bulk(transport.encode_message(transport.Ack("syncer")), BULK)
    forged = transport.Frame("syncer", 1, {"version": 2}, b"")
    with pytest.raises(ProtocolError, match="Bulk.global_step: missing"):
        serde.fragment_from_bulk(transport.encode_message(forged), BULK)
    ident = {"run_id": "", "epoch": 0, "resumed_from": 0}
    forged = transport.Frame("syncer", 0, {"version": 2, "global_step": 3, **ident}, transport.decode_message(data).payload)
    with pytest.raises(ProtocolError, match="^fragment 0: "):
        serde.fragment_from_bulk(transport.encode_message(forged), BULK)
    with pytest.raises(ProtocolError, match="bulk fragment 0: "):
        serde.fragment_to_bulk(0, 1, 1, {"a": values()["a"]}, BULK)  # not the whole fragment
    with pytest.raises(ProtocolError, match="bulk fragment 1: "):
        serde.fragment_to_bulk(1, 1, 1, {"c": np.full(5, np.nan, np.float32)}, BULK)


# ---- the network thread: core messages in, core messages out, over loopback ----------

TOKEN = "serde-test-token-0123456"


class CoreHandler:
    """A syncer stand-in: frames -> core messages with serde, bulk objects from serde."""

    def __init__(self):
        self.metadata, self.uploads, self.hub = [], [], transport.UpdateHub(64 * 1024)

    async def on_metadata(self, frame):
        self.metadata.append(serde.metadata_from_frame(frame, 4))

    async def on_fragment(self, frame):
        self.uploads.append(serde.upload_from_frame(frame, FP32, 4))
        return transport.Ack("syncer", global_step=len(self.uploads))

    def subscribe(self, msg):
        return self.hub.stream(msg.sender)

    async def bulk(self, request):
        data = serde.fragment_to_bulk(0, 5, 40, values(4), BULK)
        return transport.BulkSource(len(data), [data])


NET_CFG = transport.TransportConfig(chunk_bytes=64 * 1024, max_message_bytes=4 << 20, call_timeout_s=10.0,
                                    retry_budget_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.2)


@contextlib.contextmanager
def core_server():
    """A CoreHandler behind a real transport server on its own loop thread: (loop, handler, server); stopped
    on the way out, also when the test fails."""
    loop = transport.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    handler = CoreHandler()
    server = transport.TransportServer(handler, TOKEN, NET_CFG, "127.0.0.1:0")
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield loop, handler, server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_netthread_speaks_core_messages_over_loopback():
    import time

    from wan_diloco.core.messages import ObjectRequest
    import concurrent.futures

    from wan_diloco.runtime.inbox import Arrived, Saved
    from wan_diloco.runtime.netthread import NetThread

    with core_server() as (loop, handler, server):
        net = NetThread(server.target, TOKEN, NET_CFG, "learner-1", "eu", FP32, BULK).start()
        try:
            m = metadata(learner=1)
            net.send_metadata(m)
            up = upload(learner=1)
            assert net.upload(up).result(10).global_step == 1
            assert_same(handler.uploads[0], up, "delta")
            deadline = time.monotonic() + 10
            while not (handler.metadata and "learner-1" in handler.hub.subscribers) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert handler.metadata == [m]

            g = update()
            bad = transport.Frame("syncer", 1, {"to_version": 1}, b"")  # refused, counted, not in the inbox
            loop.call_soon_threadsafe(handler.hub.publish, bad)
            loop.call_soon_threadsafe(handler.hub.publish, serde.to_frame(g))
            item = net.next(block_s=10)
            assert type(item) is Arrived and item.arrived_s <= time.monotonic()
            assert_same(item.update, g, "update")
            assert net.bad_updates == 1 and net.inbox.empty() and net.queued_bytes() == 0

            # The inbox holds the core's own classes, matched on as such (no class names as strings).
            ident, barrier = serde.Identity("run-a", 2, 1, "p1"), serde.Barrier(True, 2, (0, 1), ())
            sent = (ident, barrier, serde.Donate(0, (5, 0)), serde.SnapshotCut(4, 2))
            for msg in sent:
                loop.call_soon_threadsafe(handler.hub.publish, serde.control_to_frame(msg))
            got = [net.next(block_s=10) for _ in range(len(sent))]
            assert got == list(sent)
            assert [type(m).__module__ for m in got] == ["wan_diloco.core.messages"] * len(sent)
            saved = Saved(3, concurrent.futures.Future())
            net.inbox.put(saved)
            assert net.next() is saved

            for request in ("fragment/0", ObjectRequest("fragment", 0)):
                p, version, step, out = net.fetch_fragment(request).result(10)[:4]
                assert (p, version, step) == (0, 5, 40) and all(out[n].tobytes() == values(4)[n].tobytes()
                                                                for n in out)
            with pytest.raises(ProtocolError, match="unknown bulk object 'theta/0'") as e:
                net.fetch_bytes("theta/0")  # no syncer serves it: refused here, nothing sent
            assert e.value.field == "object"
            with pytest.raises(ProtocolError, match="FragmentUpload.payload"):
                net.upload(upload(learner=1, payload=None))  # refused on the caller's thread, nothing sent
            net.wait_uploads(5)
            assert net.bytes_sent > up.nbytes and net.bytes_received > 0 and len(handler.uploads) == 1
        finally:
            net.stop()


def test_a_learner_that_does_not_take_its_updates_holds_back_the_stream_not_its_memory():
    import queue
    import time

    from wan_diloco.runtime.netthread import NetThread

    one = update().nbytes
    with core_server() as (loop, handler, server):
        net = NetThread(server.target, TOKEN, NET_CFG, "learner-1", "eu", FP32, BULK, inbox_bytes=2 * one).start()
        try:
            deadline = time.monotonic() + 10
            while "learner-1" not in handler.hub.subscribers and time.monotonic() < deadline:
                time.sleep(0.02)
            def publish(v):
                loop.call_soon_threadsafe(handler.hub.publish, serde.to_frame(update(from_version=v - 1, to_version=v)))

            # Forty versions of fragment 0, nobody taking them. The first two one at a time: published at once,
            # the syncer's mailbox (newest of each fragment) could fold them into one before the stream reads.
            for v in (5, 6):
                publish(v)
                deadline = time.monotonic() + 20
                while net.inbox.qsize() < v - 4 and time.monotonic() < deadline:
                    time.sleep(0.02)
            for v in range(7, 45):
                publish(v)
            time.sleep(1.0)  # time for more to arrive, were nothing holding them back
            assert net.inbox.qsize() == 2 and net.queued_bytes() == 2 * one  # the bound, not forty
            got = []
            while True:
                try:
                    item = net.next(block_s=1.0)
                except queue.Empty:
                    break
                got.append(item.update.to_version)
            # What was held back stayed in the syncer's mailbox, which keeps the newest of each fragment.
            assert got[-1] == 44 and len(got) < 40 and got == sorted(got) and net.queued_bytes() == 0
        finally:
            net.stop()


def test_control_frames_round_trip_and_updates_are_not_control_frames():
    for msg in (serde.Identity("run-a", 3, 7), serde.Donate(2, (4, 5))):
        frame = transport.decode_message(transport.encode_message(serde.control_to_frame(msg)))
        assert serde.control_from_frame(frame) == msg
    assert serde.control_to_frame(serde.Donate(2, (4, 5))).fragment == serde.DONATE_KEY + 2
    assert serde.control_from_frame(serde.to_frame(update())) is None
    ident = serde.Identity("run-a", 3, 7)
    for bad in (transport.Frame("learner-0", 0, {"identity": serde._meta_of(ident)}),
                transport.Frame("syncer", 0, {"identity": {"run_id": "a", "epoch": -1, "resumed_from": 0}}),
                transport.Frame("syncer", 0, {"identity": serde._meta_of(ident), "more": 1})):
        with pytest.raises(ProtocolError, match="Identity"):
            serde.control_from_frame(bad)


def test_a_snapshot_cut_is_a_control_frame_of_its_own_kind_and_refuses_malformed_fields():
    from wan_diloco.core.messages import SnapshotCut

    cut = SnapshotCut(snapshot=7, epoch=2)
    frame = transport.decode_message(transport.encode_message(serde.control_to_frame(cut)))
    assert frame.meta == {"cut": {"snapshot": 7, "epoch": 2}} and frame.fragment == serde.CUT_KEY
    assert serde.control_from_frame(frame) == cut and type(serde.control_from_frame(frame)) is SnapshotCut
    assert len({serde.CUT_KEY, serde.BARRIER_KEY, serde.DONATE_KEY}) == 3  # a cut never replaces another kind
    assert "snapshot" not in serde.to_frame(update()).meta  # the field it replaced is gone from updates
    for meta, field, match in [
        ({"snapshot": -1, "epoch": 2}, "cut.snapshot", "SnapshotCut.snapshot: expected a non-negative integer"),
        ({"snapshot": 7, "epoch": "2"}, "cut.epoch", "SnapshotCut.epoch: expected a non-negative integer"),
        ({"snapshot": 7}, "cut.epoch", "SnapshotCut.epoch: missing"),
        ({"snapshot": 7, "epoch": 2, "run": 1}, "cut.unknown", "SnapshotCut.run: unknown field"),
        ([7, 2], "frame", "SnapshotCut: meta must be an object"),
    ]:
        with pytest.raises(ProtocolError, match=match) as e:
            serde.control_from_frame(transport.Frame("syncer", serde.CUT_KEY, {"cut": meta}))
        assert e.value.field == field
    for bad in (transport.Frame("learner-0", serde.CUT_KEY, {"cut": {"snapshot": 7, "epoch": 2}}),
                transport.Frame("syncer", serde.CUT_KEY, {"cut": {"snapshot": 7, "epoch": 2}}, b"x")):
        with pytest.raises(ProtocolError, match="SnapshotCut: a frame from the syncer with only meta.cut"):
            serde.control_from_frame(bad)


def test_a_learner_of_protocol_version_one_is_refused_at_its_hello_with_one_line():
    from wan_diloco.core import fingerprint

    assert serde.PROTOCOL_VERSION == 2  # 2: the snapshot announcement became SnapshotCut
    old = "protocol=version:1;layout=#0"
    frame = with_meta(wire(metadata()), fingerprint=old)
    with pytest.raises(ProtocolError) as e:
        serde.metadata_from_frame(frame, 4)
    assert str(e.value) == f"learner 2: {fingerprint.SETTINGS_DIFFER}: protocol version (protocol.version 1 vs 2)"
    assert e.value.field == "fingerprint"


def test_donation_frames_name_donor_and_recipient_and_refuse_nonsense():
    state = bytes(range(256)) * 5
    frames = list(serde.donation_frames(1, 2, (3, 4), state, part_bytes=500))
    assert [len(f.payload) for f in frames] == [500, 500, 280]  # parts of at most part_bytes, in order
    got = [serde.donation_from_frame(transport.decode_message(transport.encode_message(f)), 4) for f in frames]
    assert [(d, m.recipient, m.versions, m.offset, m.total_bytes) for d, m in got] == \
        [(1, 2, (3, 4), o, 1280) for o in (0, 500, 1000)]
    assert {m.digest for _, m in got} == {serde.bytes_digest(state)}
    assert serde.donation_from_frame(serde.to_frame(upload()), 4) is None
    msg = got[0][1]
    for bad, why in ((dataclasses.replace(msg, recipient=1), "recipient: 1 is not another learner"),
                     (dataclasses.replace(msg, recipient=9), "recipient: 9"),
                     (dataclasses.replace(msg, offset=1000), "does not fit a state of 1280 bytes"),
                     (dataclasses.replace(msg, digest="XYZ"), "digest")):
        with pytest.raises(ProtocolError, match=why):
            serde.donation_from_frame(serde.donation_to_frame(1, bad, b"x" * 300), 4)
    with pytest.raises(ProtocolError, match="part of 0 bytes"):
        serde.donation_from_frame(serde.donation_to_frame(1, msg, b""), 4)


# ---- the message table: kinds on the Upload RPC, refusals by field --------------------------


def test_the_upload_rpc_names_the_kind_of_each_frame_and_accepts_the_form_without_it():
    up_frame = wire(upload())
    part = next(serde.donation_frames(1, 2, (3, 4), b"state", part_bytes=500))
    assert up_frame.meta["kind"] == "upload" and part.meta["kind"] == "donation"
    assert serde.donation_from_frame(up_frame, 4) is None
    assert_same(serde.upload_from_frame(up_frame, FP32, 4), upload(), "delta")
    donor, msg = serde.donation_from_frame(part, 4)
    assert (donor, msg.recipient, msg.versions, msg.total_bytes) == (1, 2, (3, 4), 5)
    # Frames from before the table named kinds: an upload's fields alone, a donation under meta.donation.
    old_up = with_meta(up_frame, kind=DROP)
    assert "kind" not in old_up.meta and serde.donation_from_frame(old_up, 4) is None
    assert_same(serde.upload_from_frame(old_up, FP32, 4), upload(), "delta")
    old_part = dataclasses.replace(part, meta={"donation": {k: v for k, v in part.meta.items() if k != "kind"}})
    assert serde.donation_from_frame(old_part, 4) == (donor, msg)


@pytest.mark.parametrize("kind", ["update", "metadata", "", 1, None])
def test_an_upload_frame_of_another_kind_is_refused_by_its_kind_field(kind):
    frame = with_meta(wire(upload()), kind=kind)
    assert serde.donation_from_frame(frame, 4) is None
    with pytest.raises(ProtocolError, match="FragmentUpload.kind: expected 'upload'") as e:
        serde.upload_from_frame(frame, FP32, 4)
    assert e.value.field == "upload.kind"


@pytest.mark.parametrize("decode, frame, field", [
    # The field of every refusal is the table's "<kind>.<field>" ("frame" where no one field is to blame):
    # what the syncer counts refusals by, without reading it back out of the text.
    ("metadata", lambda: with_meta(wire(metadata()), step=-1), "metadata.step"),
    ("metadata", lambda: with_meta(wire(metadata()), step_s=DROP), "metadata.step_s"),
    ("metadata", lambda: dataclasses.replace(wire(metadata()), fragment=1), "metadata.fragment"),
    ("metadata", lambda: dataclasses.replace(wire(metadata()), payload=b"x"), "metadata.payload"),
    ("metadata", lambda: dataclasses.replace(wire(metadata()), sender="syncer"), "metadata.sender"),
    ("metadata", lambda: dataclasses.replace(wire(metadata()), meta=[1]), "frame"),
    ("metadata", lambda: with_meta(wire(metadata()), made_up_1=1), "metadata.unknown"),
    ("upload", lambda: with_meta(wire(upload()), base_version="3"), "upload.base_version"),
    ("upload", lambda: dataclasses.replace(wire(upload()), payload=b"junk"), "frame"),
    ("upload", lambda: dataclasses.replace(wire(upload()), sender="learner-9"), "upload.sender"),
    ("donation", lambda: serde.donation_to_frame(1, serde.Donation(1, (0,), 0, 5, "0" * 16), b"x"),
     "donation.recipient"),
    ("donation", lambda: serde.donation_to_frame(1, serde.Donation(2, (0,), 0, 5, "XYZ"), b"x"), "donation.digest"),
    ("donation", lambda: serde.donation_to_frame(1, serde.Donation(2, (0,), 4, 5, "0" * 16), b"xx"), "frame"),
    ("update", lambda: with_meta(wire(update()), held_s=[1]), "update.held_s"),
    ("update", lambda: dataclasses.replace(wire(update()), sender="learner-0"), "update.sender"),
])
def test_every_decode_refusal_names_its_field(decode, frame, field):
    run = {"metadata": lambda f: serde.metadata_from_frame(f, 4),
           "upload": lambda f: serde.upload_from_frame(f, FP32, 4),
           "donation": lambda f: serde.donation_from_frame(f, 4),
           "update": lambda f: serde.update_from_frame(f, FP32)}[decode]
    with pytest.raises(ProtocolError) as e:
        run(frame())
    assert e.value.field == field, str(e.value)


def test_serde_defines_no_message_of_its_own():
    from wan_diloco.core import messages
    for name in ("Identity", "Donate", "Donation", "Barrier", "SnapshotCut", "BulkFragment", "_Bulk"):
        cls = getattr(serde, name)
        assert cls.__module__ == "wan_diloco.core.messages" and cls in {*messages.KIND_OF, messages.BulkFragment}
    own = [n for n, v in vars(serde).items() if isinstance(v, type) and v.__module__ == serde.__name__
           and (dataclasses.is_dataclass(v) or issubclass(v, tuple)) and n != "_Field"]
    assert own == []
