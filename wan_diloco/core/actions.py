"""The closed sets of actions the cores return, one per side.

Every core piece (``LearnerCore`` and the learner-side ``restore``, ``peer``, ``rejoin``; ``SyncerCore``
and the syncer-side ``snapshots``, ``recovery``, ``barrier``) returns only actions listed here, and a
driver carries them out with one ``match`` ending in ``typing.assert_never``: an action added to a
core without a case in every driver fails a test (tests/core/test_actions.py) and a type checker.
"""
from __future__ import annotations

import typing

from wan_diloco.core.barrier import AnnounceBarrier, FailRun
from wan_diloco.core.peer import SendState
from wan_diloco.core.protocol import (
    ApplyGlobal, Broadcast, Rejoin, Resync, SaveState, SendFragment, SendMetadata, SetTimer, Snapshot,
)
from wan_diloco.core.recovery import AskDonor, NoDonor, RecoveryStarted, StateReady, StateTaken
from wan_diloco.core.rejoin import Resynced, TakeUpStep
from wan_diloco.core.reports import Report
from wan_diloco.core.restore import InstallPart, LoadPart, RecoverFromPeer, TakeUpPosition
from wan_diloco.core.snapshots import AnnounceSnapshot, SnapshotComplete, WriteManifest, WriteSyncerPart

LearnerAction = typing.Union[
    ApplyGlobal, Snapshot, SendFragment, SendMetadata, Resync, Rejoin, SaveState,  # LearnerCore
    LoadPart, InstallPart, TakeUpPosition, RecoverFromPeer, Report,  # restore.Resume
    SendState,  # peer.Donor
    Resynced, TakeUpStep,  # rejoin
]

SyncerAction = typing.Union[
    Broadcast, SetTimer,  # SyncerCore
    WriteSyncerPart, AnnounceSnapshot, WriteManifest, SnapshotComplete,  # snapshots.SnapshotCoordinator
    AskDonor, NoDonor, RecoveryStarted, StateReady, StateTaken,  # recovery.Donations
    AnnounceBarrier, FailRun,  # barrier.StartBarrier
]

LEARNER_ACTIONS: frozenset[type] = frozenset(typing.get_args(LearnerAction))
SYNCER_ACTIONS: frozenset[type] = frozenset(typing.get_args(SyncerAction))
