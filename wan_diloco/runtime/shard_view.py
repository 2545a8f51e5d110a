"""Moved: ``ShardView`` (S syncer shards seen by a learner as one syncer) is sans-IO and lives in
``wan_diloco.core.shards`` beside ``ShardPlan``; this name stays for the network thread's import."""
from wan_diloco.core.shards import ShardPlan, ShardView

__all__ = ["ShardPlan", "ShardView"]
