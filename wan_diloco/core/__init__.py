"""Sans-IO learner and syncer state machines: events in, actions out, no sockets or clocks.

``messages`` is the project's only message table (re-exported by ``protocol``, with the actions);
``actions`` closes the set of actions each side returns. The drivers (``sim``, ``runtime``) turn
messages into events or transport frames and carry actions out with one exhaustive match.
"""
from wan_diloco.core.learner import LearnerConfig, LearnerCore
from wan_diloco.core.protocol import (
    FINAL_TIMER, ApplyGlobal, Broadcast, Codec, FragmentUpload, GlobalUpdate, IncarnationError, Metadata,
    ProtocolError, Rejoin, Resync, SaveState, SendFragment, SendMetadata, SetTimer, Snapshot, learner_node,
)
from wan_diloco.core.syncer import SyncerConfig, SyncerCore

__all__ = [
    "FINAL_TIMER", "ApplyGlobal", "Broadcast", "Codec", "FragmentUpload", "GlobalUpdate", "IncarnationError",
    "LearnerConfig", "LearnerCore", "Metadata", "ProtocolError", "Rejoin", "Resync", "SaveState", "SendFragment",
    "SendMetadata", "SetTimer", "Snapshot",
    "SyncerConfig", "SyncerCore", "learner_node",
]
