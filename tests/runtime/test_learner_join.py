"""runtime.learner_join through a real NetThread and two fake syncer shards on loopback: after shard 1 resumes
at a new incarnation the learner fetches shard 1's fragments only and keeps its copies of shard 0's."""
import asyncio
import collections
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import LearnerConfig, LearnerCore, Rejoin
from wan_diloco.core import rejoin as rj
from wan_diloco.core.messages import Identity
from wan_diloco.core.shards import OTHER_SHARD_RESUMED, ShardPlan
from wan_diloco.fragments import Layout
from wan_diloco.runtime import learner_join, serde
from wan_diloco.runtime.exits import SyncerLost
from wan_diloco.runtime.netthread import NetThread
from wan_diloco.transport import BulkSource, TransportConfig, TransportServer

TOKEN = "join-test-token-0123456789"
FRAGS = [(f"f{p}/w",) for p in range(4)]
SHAPES = {f"f{p}/w": (8 + p,) for p in range(4)}
LAYOUT = Layout(FRAGS, SHAPES)
CONFIG = TransportConfig(call_timeout_s=5.0, retry_budget_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.2,
                         probe_every_s=0.0)
BULK = FragmentCodec(CodecConfig(bits=32, zstd=False), LAYOUT)


def values(p: int, fill: float) -> dict:
    return {n: np.full(SHAPES[n], fill, np.float32) for n in FRAGS[p]}


class FakeShard:
    """A syncer shard that serves its fragments by bulk, counts what was asked, and says who it is."""

    def __init__(self, owned: list[int], loop: asyncio.AbstractEventLoop):
        self.owned, self.loop, self.epoch, self.resumed_from, self.fill = owned, loop, 1, 0, 1.0
        self.asked: list[str] = []
        self.said: asyncio.Queue | None = None

    def identity(self) -> Identity:
        return Identity("run-j", self.epoch, self.resumed_from, f"process-{self.epoch}")

    async def on_metadata(self, frame):
        return None

    async def on_fragment(self, frame):
        return None

    async def subscribe(self, msg):
        self.said = asyncio.Queue()
        yield serde.control_to_frame(self.identity())
        while True:
            yield await self.said.get()

    async def bulk(self, request):
        self.asked.append(request.name)
        p = int(request.name.split("/")[1])
        assert p in self.owned, f"{request.name} asked of a shard that does not own it"
        data = serde.fragment_to_bulk(p, self.epoch * 10, 5, values(p, self.fill), BULK, "run-j", self.epoch,
                                      self.resumed_from)
        return BulkSource(len(data), [data])

    def resume(self, snapshot: int) -> None:
        """Killed and resumed from its snapshot: a new incarnation with other values; its stream says so."""
        self.epoch, self.resumed_from, self.fill = self.epoch + 1, snapshot, 7.0
        self.loop.call_soon_threadsafe(self.said.put_nowait, serde.control_to_frame(self.identity()))


@pytest.fixture
def shards():
    plan = ShardPlan.balanced(LAYOUT.nbytes, 2)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fakes = [FakeShard(plan.owned(s), loop) for s in range(2)]
    servers = [TransportServer(f, TOKEN, CONFIG) for f in fakes]
    try:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        yield plan, fakes, ",".join(s.target for s in servers)
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class JoiningLearner:
    """What ``learner_join.join`` uses of a ``Learner``: the real core and network thread, no model."""

    def __init__(self, net: NetThread):
        self.m, self.net, self.sync, self.pending_resync = 0, net, None, {}
        codec = FragmentCodec(CodecConfig(bits=32), LAYOUT)
        self.core = LearnerCore(LearnerConfig(sync_every=4, num_fragments=4, tau=1), 0, FRAGS,
                                {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, codec)
        self.actions: list = []

    def wait(self, fut, timeout_s):
        return fut.result(timeout_s)

    def handle(self, actions):
        self.actions += actions

    def take_up_step(self):
        pass

    join = learner_join.join

    def next_control(self, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            item = self.net.next(max(0.01, deadline - time.monotonic()))
            if isinstance(item, Identity):
                return item


def fetched(fakes) -> list[collections.Counter]:
    return [collections.Counter(f.asked) for f in fakes]


def test_after_shard_one_resumes_a_learner_fetches_only_its_fragments_and_keeps_shard_zeros(shards):
    plan, fakes, target = shards
    zero, one = plan.owned(0), plan.owned(1)
    assert zero and one
    codec = FragmentCodec(CodecConfig(bits=32), LAYOUT)
    net = NetThread(target, TOKEN, CONFIG, "learner-0", "r", codec, BULK).start()
    try:
        lrn = JoiningLearner(net)
        for _ in range(2):  # each shard's stream says who it is
            lrn.handle(rj.on_identity(lrn.core, 0.0, *_fields(lrn.next_control())))
        assert lrn.actions == []  # not joined yet: nothing to rejoin
        first = lrn.join(5.0)
        assert (first.run_id, first.epoch, lrn.core.epoch) == ("run-j", 1, 1)
        assert fetched(fakes) == [collections.Counter(f"fragment/{p}" for p in zero),
                                  collections.Counter(f"fragment/{p}" for p in one)]  # the start: every fragment once
        before = {p: dict(lrn.core.base[p]) for p in zero}

        fakes[1].resume(snapshot=12)
        rejoin = rj.on_identity(lrn.core, 0.0, *_fields(lrn.next_control()))
        assert rejoin == [Rejoin(2, OTHER_SHARD_RESUMED)]  # E = 2; shard 0 (the learners' parts) lost nothing
        assert net.refetch(lrn.core.epoch) == one
        lrn.join(5.0)

        counts = fetched(fakes)
        assert sum(counts[0].values()) == len(zero)  # shard 0 was not asked again
        assert counts[1] == collections.Counter({f"fragment/{p}": 2 for p in one})
        assert lrn.core.epoch == 2 and lrn.core.resumed_from == OTHER_SHARD_RESUMED
        for p in one:  # the resumed shard's values and version
            assert lrn.core.version[p] == 20 and all((a == 7.0).all() for a in lrn.core.base[p].values())
        for p in zero:  # its own copies of shard 0's, untouched
            assert lrn.core.version[p] == 10
            assert all(np.array_equal(lrn.core.base[p][n], before[p][n]) for n in before[p])
    finally:
        net.stop()


def test_with_one_syncer_a_join_fetches_every_fragment():
    net = NetThread("127.0.0.1:1", TOKEN, CONFIG, "learner-0", "r", FragmentCodec(CodecConfig(bits=32), LAYOUT), BULK)
    assert net.refetch(0) == net.refetch(3) == [0, 1, 2, 3]  # no view, no loop needed


def _fields(identity: Identity) -> tuple:
    return identity.run_id, identity.epoch, identity.resumed_from, identity.process


def test_a_join_whose_fragments_disagree_on_the_incarnation_each_time_gives_up():
    class Flapping:
        """Each fetch answers from another incarnation (a syncer restarting while the learner fetches)."""
        codec = FragmentCodec(CodecConfig(bits=32), LAYOUT)
        n = 0

        def refetch(self, epoch):
            return [0, 1, 2, 3]

        def fetch_fragment(self, request):
            self.n += 1
            fut = concurrent.futures.Future()
            fut.set_result(serde.fragment_from_bulk(serde.fragment_to_bulk(
                request.index, 1, 0, values(request.index, 1.0), BULK, "run-j", self.n), BULK))
            return fut

    net = Flapping()
    with pytest.raises(SyncerLost, match=f"during each of {rj.JOIN_TRIES} joins"):
        learner_join.fetch(net, 0, lambda fut: fut.result(), 0)
    assert net.n == 4 * rj.JOIN_TRIES
