import asyncio

import pytest

from wan_diloco.transport import Frame, LatestMailbox, MessageError, UpdateHub, new_event_loop
from wan_diloco.transport.framing import Prepared
from wan_diloco.transport.loop import have_uvloop

from .conftest import arun


def update(fragment, version, payload=b"x" * 10):
    return Frame("syncer", fragment, {"version": version}, payload)


def test_mailbox_keeps_only_the_newest_publication_per_fragment():
    async def main():
        box = LatestMailbox()
        for fragment, seq in [(0, 1), (1, 1), (0, 3), (0, 2), (2, 1)]:
            box.put(Prepared.of(update(fragment, seq), 1024, seq=seq))
        assert len(box) == 3 and box.dropped == 1  # (0,1) replaced by (0,3); (0,2) is older, ignored
        got = [(await box.get(box.generation)).message for _ in range(3)]
        assert [(m.fragment, m.meta["version"]) for m in got] == [(1, 1), (0, 3), (2, 1)]
    arun(main())


def test_hub_orders_by_publication_not_by_anything_in_meta():
    async def main():
        hub = UpdateHub(chunk_bytes=1 << 16)
        hub.mailbox("a")
        hub.publish(update(0, 9))
        hub.publish(update(0, 1))  # meta is opaque: the later publication wins
        (item,) = hub.mailbox("a")._pending.values()
        assert item.message.meta == {"version": 1} and item.seq == 2
    arun(main())


def test_publish_refuses_what_it_cannot_encode_and_queues_nothing():
    hub = UpdateHub(chunk_bytes=1 << 16)
    hub.mailbox("a")
    with pytest.raises(MessageError, match="not a JSON value"):
        hub.publish(Frame("syncer", 0, {"x": object()}))
    with pytest.raises(TypeError, match="publish takes a Frame"):
        hub.publish({"fragment": 0})
    assert len(hub.mailbox("a")) == 0


def test_hub_memory_is_bounded_by_fragments_not_by_updates():
    async def main():
        hub = UpdateHub(chunk_bytes=1 << 16)
        for learner in ("a", "b", "c"):
            hub.mailbox(learner)
        for version in range(100):
            for fragment in range(4):
                hub.publish(update(fragment, version))
        for learner in hub.subscribers:
            box = hub.mailbox(learner)
            assert len(box) == 4 and box.dropped == 396
        # one encoding shared by every subscriber
        assert hub.mailbox("a")._pending[0] is hub.mailbox("c")._pending[0]
    arun(main())


def test_interrupted_delivery_is_requeued_and_stream_ends_when_forgotten():
    async def main():
        hub = UpdateHub(chunk_bytes=1 << 16)
        stream = hub.stream("a")
        hub.publish(update(0, 1))
        first = await stream.__anext__()
        assert first.message.meta["version"] == 1
        await stream.aclose()  # closed while holding the item: it goes back
        assert len(hub.mailbox("a")) == 1
        stream = hub.stream("a")
        assert (await stream.__anext__()).message.meta["version"] == 1
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        hub.forget("a")
        assert await asyncio.gather(waiting, return_exceptions=True) != [None]
        assert isinstance(waiting.exception(), StopAsyncIteration)
    arun(main())


def test_new_event_loop_prefers_uvloop():
    loop = new_event_loop()
    try:
        assert ("uvloop" in type(loop).__module__) == have_uvloop()
    finally:
        loop.close()


def test_interrupted_delivery_never_replaces_a_newer_publication():
    async def main():
        hub = UpdateHub(chunk_bytes=1 << 16)
        stream = hub.stream("a")
        hub.publish(update(0, 1))
        assert (await stream.__anext__()).message.meta["version"] == 1
        hub.publish(update(0, 2))  # published while version 1 is being delivered
        await stream.aclose()  # version 1 comes back, but 2 is newer
        (item,) = hub.mailbox("a")._pending.values()
        assert item.message.meta["version"] == 2 and hub.mailbox("a").dropped == 0
    arun(main())
