"""Sans-IO learner and syncer state machines: events in, actions out, no sockets or clocks."""
from wan_diloco.core.learner import LearnerConfig, LearnerCore
from wan_diloco.core.protocol import (
    ApplyGlobal, Broadcast, Codec, Encoded, Float32Codec, FragmentUpload, GlobalUpdate, Metadata,
    ProtocolError, Resync, SendFragment, SendMetadata, SetTimer, Snapshot, learner_node,
)
from wan_diloco.core.syncer import SyncerConfig, SyncerCore

__all__ = [
    "ApplyGlobal", "Broadcast", "Codec", "Encoded", "Float32Codec", "FragmentUpload", "GlobalUpdate",
    "LearnerConfig", "LearnerCore", "Metadata", "ProtocolError", "Resync", "SendFragment", "SendMetadata",
    "SetTimer", "Snapshot", "SyncerConfig", "SyncerCore", "learner_node",
]
