"""What a named bulk request gets from a syncer shard, and when the end of the run is done."""
import dataclasses

import pytest

from wan_diloco.core import ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.core.objects import FinalSync, ServeDonation, ServeFragment, ServePosition, route
from wan_diloco.core.shards import ShardPlan

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, meta, upload

PLAN = ShardPlan([0, 1])


def at(shard, name, sender="learner-1"):
    return route(name, sender, plan=PLAN, shard=shard, num_learners=2, position_of=lambda m: f"pos{m}")


def test_each_request_is_served_by_its_shard_to_its_learner():
    assert at(0, "fragment/0") == ServeFragment(0, final=False) and at(1, "final/1") == ServeFragment(1, final=True)
    assert at(0, "position/1") == ServePosition(1, b"pos1") and at(0, "donation/1") == ServeDonation(1)
    with pytest.raises(ProtocolError, match="fragment 1 is served by syncer shard 1, this is shard 0"):
        at(0, "fragment/1")
    with pytest.raises(ProtocolError, match="peer recovery is served by syncer shard 0, this is shard 1"):
        at(1, "donation/1")
    with pytest.raises(ProtocolError, match="donation/0 is for learner-0, not 'learner-1'"):
        at(0, "donation/0")
    for bad in ("fragment/2", "fragment/01", "checkpoint/0", "position/2"):
        with pytest.raises(ProtocolError, match="unknown bulk object") as e:
            at(0, bad)
        assert e.value.field == "object"


def test_the_syncer_ends_once_everyone_fetched_every_final_fragment_and_the_parameters_are_written():
    core = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    fin = FinalSync(core)
    for m in (0, 1):
        core.on_metadata(0.0, meta(m, step=4))
    assert not fin.on_upload(0, final=True)  # not late: the final sync is still open
    core.on_fragment(1.0, dataclasses.replace(upload(0, fragment=0, due=8), final=True))
    assert not fin.on_merged() and not fin.finished()  # learner 0's fragment 1 and learner 1 are missing
    core.on_peer_lost(1.5, 1)
    core.on_fragment(2.0, dataclasses.replace(upload(0, fragment=1, due=8), final=True))
    assert core.final_done and fin.on_merged() and not fin.on_merged()  # once
    assert fin.on_upload(1, final=True) and fin.late == {1}  # learner 1 came back too late: it gets them too
    assert not fin.on_fetched(0, 0) and not fin.on_fetched(0, 1)  # the parameters are not written yet
    assert not fin.on_saved()  # learner 1 has not fetched
    assert not fin.on_fetched(1, 0) and fin.on_fetched(1, 1) and fin.finished()
