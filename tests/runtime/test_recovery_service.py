"""The syncer's side of peer recovery, in process (#13): the donor it asks is lost mid-transfer, the next
one is asked, its state reaches the recipient by bulk, and the first donor's late answer is refused."""
import asyncio

import pytest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import BulkRequest, Rejected, Subscribe, TransportMetrics, run

from .conftest import micro_config


def metadata(m, step, recovering=False):
    return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                   clock=VectorClock({f"learner-{m}": step}), recovering=recovering))


def donates(service, donor):
    """The Donate frames waiting in ``donor``'s mailbox (what its update stream would deliver)."""
    box = service.hub.mailbox(f"learner-{donor}")
    return [serde.control_from_frame(p.message) for p in box._pending.values()
            if isinstance(serde.control_from_frame(p.message), serde.Donate)]


def test_a_donor_lost_mid_transfer_is_replaced_and_the_state_reaches_the_recipient(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=3))
    service = SyncerService(cfg, TransportMetrics())

    async def main():
        # Learner 0 is the most advanced, so it is asked first; it has an update stream open.
        stream0 = service.subscribe(Subscribe("learner-0", cfg.region(0), "i0"))
        assert isinstance(serde.control_from_frame(await anext(stream0)), serde.Identity)  # every stream starts so
        await service.on_metadata(metadata(0, 30))
        await service.on_metadata(metadata(1, 20))
        fetch = asyncio.ensure_future(service.bulk(BulkRequest("learner-2", "donation/2", {})))
        await service.on_metadata(metadata(2, 0, recovering=True))
        assert [d.recipient for d in donates(service, 0)] == [2] and donates(service, 1) == []
        await stream0.aclose()  # learner 0 goes away before sending anything
        assert [d.recipient for d in donates(service, 1)] == [2]
        state = b"the state of learner 1"
        ack = await service.on_fragment(next(serde.donation_frames(1, 2, (0, 0), state)))
        assert ack.detail == "donation"
        source = await asyncio.wait_for(fetch, 5)
        assert b"".join(bytes(p) for p in source.pieces) == state and source.etag == serde.bytes_digest(state)
        with pytest.raises(Rejected, match="was not asked"):  # the lost donor's late answer
            await service.on_fragment(next(serde.donation_frames(0, 2, (0, 0), b"late")))
        return service.donations.replaced, service.donations.served, service.donations.received_bytes

    assert run(asyncio.wait_for(main(), 60)) == (1, 1, len(b"the state of learner 1"))


def test_the_syncer_hands_a_learner_back_its_data_position_and_only_to_it(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2))
    service = SyncerService(cfg, TransportMetrics())

    async def fetch(sender, name):
        source = await service.bulk(BulkRequest(sender, name, {}))
        return b"".join(bytes(p) for p in source.pieces)

    async def main():
        assert await fetch("learner-1", "position/1") == b""  # never seen: nothing to hand back
        for step, data in ((3, '{"batches":3}'), (4, '{"batches":4}'), (5, "")):  # "" keeps the last one
            frame = serde.to_frame(Metadata(learner=1, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                            clock=VectorClock({"learner-1": step}), data=data))
            await service.on_metadata(frame)
        with pytest.raises(Rejected, match="is for learner-1"):
            await fetch("learner-0", "position/1")
        return await fetch("learner-1", "position/1")

    assert run(asyncio.wait_for(main(), 30)) == b'{"batches":4}'


def test_a_state_in_parts_survives_its_donor_dying_half_way_and_stays_until_it_is_taken_up(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=3))
    service = SyncerService(cfg, TransportMetrics())
    old, new = bytes(range(256)) * 40, bytes(reversed(range(256))) * 40  # two donors' states, 10240 bytes

    async def part(donor, frames, i):
        return await service.on_fragment(frames[i])

    async def main():
        stream0 = service.subscribe(Subscribe("learner-0", cfg.region(0), "i0"))
        await anext(stream0)
        await service.on_metadata(metadata(0, 30))
        await service.on_metadata(metadata(1, 20))
        await service.on_metadata(metadata(2, 0, recovering=True))
        first = list(serde.donation_frames(0, 2, (0, 0), old, part_bytes=4096))
        assert (await part(0, first, 0)).detail == "donation part"
        assert (await part(0, first, 0)).detail == "donation part"  # a part sent again lands on itself
        with pytest.raises(Rejected, match="only 4096 bytes arrived"):
            await part(0, first, 2)  # a gap
        await stream0.aclose()  # learner 0 dies half way: learner 1 is asked and starts over
        assert [d.recipient for d in donates(service, 1)] == [2]
        with pytest.raises(Rejected, match="was not asked"):
            await part(0, first, 1)
        second = list(serde.donation_frames(1, 2, (0, 0), new, part_bytes=4096))
        with pytest.raises(Rejected, match="first part never arrived"):
            await part(1, second, 1)
        acks = [(await part(1, second, i)).detail for i in range(3)]
        assert acks == ["donation part", "donation part", "donation"]
        # A broken fetch comes back for the rest (the transport skips what it has): the same bytes.
        for _ in range(2):
            source = await service.bulk(BulkRequest("learner-2", "donation/2", {}))
            assert b"".join(bytes(p) for p in source.pieces) == new and source.etag == serde.bytes_digest(new)
        await service.on_metadata(metadata(2, 31))  # it took the state up: the copy goes
        assert 2 not in service.donations.donated
        # A donor whose parts do not add up to their digest is refused and nothing is handed on.
        await service.on_metadata(metadata(2, 0, recovering=True))
        bad = list(serde.donation_frames(1, 2, (0, 0), new, part_bytes=4096))
        bad[2] = serde.donation_to_frame(1, serde.donation_from_frame(bad[2], 3)[1], b"x" * len(bad[2].payload))
        for i in range(2):
            await part(1, bad, i)
        with pytest.raises(Rejected, match="does not match its digest"):
            await part(1, bad, 2)
        assert 2 not in service.donations.donated and service.donations.donor_of(2) == 1
        huge = serde.donation_to_frame(1, serde.Donation(2, (0, 0), 0, service.donations.max_state_bytes + 1, "0" * 16), b"x")
        with pytest.raises(Rejected, match="larger than this model's state can be"):
            await service.on_fragment(huge)
        return service.donations.replaced, service.donations.served

    assert run(asyncio.wait_for(main(), 60)) == (1, 1)


def test_a_fetch_that_arrives_before_the_recovering_metadata_still_gets_the_state(tmp_path):
    # The recipient sends both at once; in a full chaos run the fetch came first, waited on an event the
    # metadata then replaced, and ran into its deadline (the newcomer went on with a fresh optimizer).
    cfg = rt.load(micro_config(tmp_path, learners=3))
    service = SyncerService(cfg, TransportMetrics())

    async def main():
        stream0 = service.subscribe(Subscribe("learner-0", cfg.region(0), "i0"))
        await anext(stream0)
        await service.on_metadata(metadata(0, 30))
        fetch = asyncio.ensure_future(service.bulk(BulkRequest("learner-2", "donation/2", {})))
        await asyncio.sleep(0.05)  # the fetch is waiting at the syncer before the metadata arrives
        await service.on_metadata(metadata(2, 0, recovering=True))
        state = b"learner 0's state"
        await service.on_fragment(next(serde.donation_frames(0, 2, (0, 0), state)))
        source = await asyncio.wait_for(fetch, 5)
        return b"".join(bytes(p) for p in source.pieces) == state

    assert run(asyncio.wait_for(main(), 30))
