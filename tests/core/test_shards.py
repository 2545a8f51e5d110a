"""Shard plan lookups: which syncer shard owns a fragment and serves a named object."""
import pytest

from wan_diloco.core import ProtocolError
from wan_diloco.core.protocol import ObjectRequest
from wan_diloco.core.shards import ShardPlan
from wan_diloco.shards import owners


def test_fragments_go_to_their_owner_recovery_and_positions_to_shard_zero():
    plan = ShardPlan([0, 1, 0, 1])
    assert plan.shards == 2 and plan.owned(1) == [1, 3] and plan.shard_of(3) == 1
    assert plan.serves(ObjectRequest("final", 1)) == 1 and plan.serves(ObjectRequest("fragment", 2)) == 0
    assert plan.serves(ObjectRequest("donation", 7)) == 0 and plan.serves(ObjectRequest("position", 1)) == 0
    with pytest.raises(ProtocolError, match="fragment 4 out of range 0..3"):
        plan.shard_of(4)


def test_the_balanced_plan_is_the_one_every_process_computes():
    nbytes = [40, 10, 30, 20]
    assert ShardPlan.balanced(nbytes, 2).plan == owners(nbytes, 2)
    with pytest.raises(ValueError):
        ShardPlan([])
