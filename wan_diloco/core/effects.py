"""The closed action sets the cores return, the effects a driver offers, and the one dispatch between them.

Every core piece (``LearnerCore`` and the learner-side ``restore``, ``peer``, ``rejoin``; ``SyncerCore``
and the syncer-side ``snapshots``, ``recovery``, ``barrier``) returns only actions of ``LearnerAction`` or
``SyncerAction``. A driver (the network learner and syncer, the simulator) implements ``LearnerEffects``
or ``SyncerEffects`` and hands each action to ``dispatch_learner`` / ``dispatch_syncer``: one exhaustive
``match`` per side, ending in ``typing.assert_never``, so an action added to a union without a case fails a
type checker and tests/core/test_effects.py, and a driver that lacks an effect fails the ``Protocol``.

Two protocols, not one: the two sides are carried out by different objects (a learner process, a syncer
service; the simulator's per-learner and per-syncer adapters), and one interface would make each of them
stub the other side's effects. Each effect is named by the issue's verb for what it does outside the core
(send, fetch, copy, apply, write/read a part, set a timer, report), with its object where a driver does
different IO for different objects. Effects return nothing: where a core decides what follows an effect
(``LearnerCore.snapshot`` after the copy, ``Resume.on_part`` after the read, ...), the driver calls it and
hands what it returns to its dispatch again.
"""
from __future__ import annotations

import typing
from typing import Any, Mapping, Protocol

from wan_diloco.core.barrier import AnnounceBarrier, FailRun
from wan_diloco.core.messages import FragmentUpload, GlobalUpdate, Metadata, SnapshotCut
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


class LearnerEffects(Protocol):
    """What a learner's driver does for the learner-side cores (each action's docstring says more)."""

    def send_fragment(self, msg: FragmentUpload) -> None: ...  # SendFragment
    def send_metadata(self, msg: Metadata) -> None: ...  # SendMetadata, with the driver's own fields
    def send_state(self, recipient: int, versions: tuple[int, ...]) -> None: ...  # SendState: donate
    def fetch_fragment(self, fragment: int) -> None: ...  # Resync: then rejoin.on_fetched
    def fetch_position(self) -> None: ...  # TakeUpPosition
    def fetch_peer_state(self, patience_s: float) -> None: ...  # RecoverFromPeer: then Resume.on_peer
    def rejoin(self, epoch: int, resumed_from: int) -> None: ...  # Rejoin: fetch every fragment, LearnerCore.join
    def copy_fragment(self, fragment: int, due_step: int, final: bool) -> None: ...  # Snapshot
    def apply_fragment(self, update: ApplyGlobal) -> None: ...  # ApplyGlobal
    def write_part(self, snapshot: int) -> None: ...  # SaveState: then LearnerCore.saved
    def read_part(self, part: LoadPart) -> None: ...  # LoadPart: then Resume.on_part
    def install_part(self, part: InstallPart) -> None: ...  # InstallPart: then Resume.on_installed
    def take_up_step(self) -> None: ...  # TakeUpStep: train step and schedule from the core's step
    def count_resync(self, fragment: int, version: int) -> None: ...  # Resynced
    def report(self, event: Mapping[str, Any]) -> None: ...  # Report


class SyncerEffects(Protocol):
    """What a syncer's driver does for the syncer-side cores (each action's docstring says more)."""

    def broadcast(self, msg: GlobalUpdate) -> None: ...  # Broadcast
    def set_timer(self, key: tuple[int, int], at_s: float) -> None: ...  # SetTimer: then SyncerCore.on_timer
    def write_part(self, part: WriteSyncerPart) -> None: ...  # then SnapshotCoordinator.on_part_written
    def announce_snapshot(self, msg: SnapshotCut) -> None: ...  # AnnounceSnapshot: to every learner
    def write_manifest(self, manifest: WriteManifest) -> None: ...  # then .on_manifest_written
    def snapshot_complete(self, done: SnapshotComplete) -> None: ...  # drop old snapshots, report
    def send_donate(self, donor: int, recipient: int, versions: tuple[int, ...]) -> None: ...  # AskDonor
    def hold_state_fetch(self, recipient: int) -> None: ...  # RecoveryStarted
    def answer_state_fetch(self, recipient: int) -> None: ...  # StateReady: the state is there
    def refuse_state_fetch(self, recipient: int, why: str) -> None: ...  # NoDonor
    def drop_state(self, recipient: int) -> None: ...  # StateTaken
    def announce_barrier(self, status: Mapping[str, Any], met: bool) -> None: ...  # AnnounceBarrier
    def fail(self, why: str) -> None: ...  # FailRun


def _not_an_action(action: object, side: str) -> TypeError:
    return TypeError(f"dispatch_{side}: {action!r} is not a {side} action (core.effects.{side.capitalize()}Action)")


def dispatch_learner(action: LearnerAction, fx: LearnerEffects) -> None:
    """Carry out one learner-side action through ``fx``: the only match over them."""
    match action:
        case SendFragment(msg=msg):
            fx.send_fragment(msg)
        case SendMetadata(msg=msg):
            fx.send_metadata(msg)
        case SendState(recipient=r, versions=versions):
            fx.send_state(r, versions)
        case Resync(fragment=p):
            fx.fetch_fragment(p)
        case TakeUpPosition():
            fx.fetch_position()
        case RecoverFromPeer(patience_s=patience_s):
            fx.fetch_peer_state(patience_s)
        case Rejoin(epoch=epoch, resumed_from=resumed_from):
            fx.rejoin(epoch, resumed_from)
        case Snapshot(fragment=p, due_step=due, final=final):
            fx.copy_fragment(p, due, final)
        case ApplyGlobal():
            fx.apply_fragment(action)
        case SaveState(snapshot=snap):
            fx.write_part(snap)
        case LoadPart():
            fx.read_part(action)
        case InstallPart():
            fx.install_part(action)
        case TakeUpStep():
            fx.take_up_step()
        case Resynced(fragment=p, version=version):
            fx.count_resync(p, version)
        case Report(event=event):
            fx.report(event)
        case _:
            if not isinstance(action, tuple(LEARNER_ACTIONS)):
                raise _not_an_action(action, "learner")
            typing.assert_never(action)


def dispatch_syncer(action: SyncerAction, fx: SyncerEffects) -> None:
    """Carry out one syncer-side action through ``fx``: the only match over them."""
    match action:
        case Broadcast(msg=msg):
            fx.broadcast(msg)
        case SetTimer(key=key, at_s=at_s):
            fx.set_timer(key, at_s)
        case WriteSyncerPart():
            fx.write_part(action)
        case AnnounceSnapshot(msg=msg):
            fx.announce_snapshot(msg)
        case WriteManifest():
            fx.write_manifest(action)
        case SnapshotComplete():
            fx.snapshot_complete(action)
        case AskDonor(donor=donor, recipient=r, versions=versions):
            fx.send_donate(donor, r, versions)
        case RecoveryStarted(recipient=r):
            fx.hold_state_fetch(r)
        case StateReady(recipient=r):
            fx.answer_state_fetch(r)
        case NoDonor(recipient=r, why=why):
            fx.refuse_state_fetch(r, why)
        case StateTaken(recipient=r):
            fx.drop_state(r)
        case AnnounceBarrier(status=status, met=met):
            fx.announce_barrier(status, met)
        case FailRun(why=why):
            fx.fail(why)
        case _:
            if not isinstance(action, tuple(SYNCER_ACTIONS)):
                raise _not_an_action(action, "syncer")
            typing.assert_never(action)
