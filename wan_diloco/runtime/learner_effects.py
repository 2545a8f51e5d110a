"""The networked learner's ``core.effects.LearnerEffects``: what each learner-side action does to this
process's train state, its network thread and its snapshot store.

A mixin of ``runtime.learner.Learner`` (it uses the learner's state, core, network thread, sync worker and
store; ``send_metadata``, ``take_up_step`` and ``join`` are the learner's own). ``handle`` is the one
place actions are carried out: ``core.effects.dispatch_learner``.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.core import ApplyGlobal, Rejoin, SaveState
from wan_diloco.core import rejoin as rj
from wan_diloco.core.effects import dispatch_learner
from wan_diloco.core.peer import SendState
from wan_diloco.core.protocol import ObjectRequest
from wan_diloco.core.restore import InstallPart, LoadPart, RecoverFromPeer
from wan_diloco.runtime import learner_state as ls_io
from wan_diloco.runtime.events import emit

# Actions that read or replace error-feedback residuals: the sync worker's jobs finish first.
_RESIDUALS = (SaveState, SendState, LoadPart, InstallPart, RecoverFromPeer, Rejoin)


class LearnerEffectsIO:
    """``Learner``'s effects (the module docstring)."""

    def handle(self, actions: list) -> None:
        for a in actions:
            if self.sync is not None and isinstance(a, _RESIDUALS):
                self.sync.flush()
            dispatch_learner(a, self)

    def apply_fragment(self, a: ApplyGlobal) -> None:
        flat = tree.flatten(self.state.params)
        # A multi-process leader mixes on the host: a jax op on the global arrays here would run
        # on its own devices only, a computation its followers never join.
        current = flat if self.ls is None else {n: np.asarray(flat[n]) for n in a.values}
        # One batched transfer of the fragment (a call per tensor costs twice the CPU).
        flat.update(jax.device_put(a.mixed(current)))
        self.state = train_lib.set_params(self.state, tree.unflatten(flat, self.state.params))

    def copy_fragment(self, fragment: int, due_step: int, final: bool) -> None:
        flat, names = tree.flatten(self.state.params), self.layout.fragments[fragment]
        if self.sync is not None and not final:
            self.sync.submit(self.core.begin_snapshot(time.monotonic(), fragment, due_step),
                             {n: flat[n] for n in names})
            return
        if self.sync is not None:  # the final sync waits for every upload: no gain in the worker
            self.sync.flush()
        theta = {n: np.asarray(flat[n]) for n in names}
        self.handle(self.core.snapshot(time.monotonic(), fragment, due_step, theta, final))

    def fetch_fragment(self, fragment: int) -> None:
        if fragment not in self.pending_resync:
            self.pending_resync[fragment] = self.net.fetch_fragment(ObjectRequest("fragment", fragment).name)

    def rejoin(self, epoch: int, resumed_from: int) -> None:
        emit(rj.rejoin_report(self.m, self.core.step, epoch, resumed_from).event)
        self.join(self.cfg.transport.call_timeout_s + self.cfg.transport.retry_budget_s)
        self.rejoins += 1

    write_part = ls_io.save_part
    send_state = ls_io.send_state
    fetch_position = ls_io.take_up_position
    report = staticmethod(emit)

    def count_resync(self, fragment: int, version: int) -> None:
        self.resyncs += 1

    def read_part(self, part: LoadPart) -> None:
        self.handle(ls_io.load_part(self, part))

    def install_part(self, part: InstallPart) -> None:
        self.handle(ls_io.install_part(self, part))

    def fetch_peer_state(self, patience_s: float) -> None:
        recovery = ls_io.recover_from_peer(self, patience_s)
        self.handle(self.resume.on_peer(time.monotonic(), recovery, self.core.step))

    def send_fragment(self, msg) -> None:
        """Count an upload and hand it to the network thread (the sync worker's go straight to the network
        thread and are counted through ``SyncWorker.check``, on the training thread)."""
        self.count_upload(msg.fragment, msg.nbytes)
        self.net.upload(msg)

    def count_upload(self, fragment: int, nbytes: int) -> None:
        """On the training thread only."""
        self.raw_bytes += self.layout.nbytes[fragment]
        self.payload_bytes += nbytes
        self.uploads += 1
