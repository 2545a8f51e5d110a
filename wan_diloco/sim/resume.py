"""A learner's restart in the simulator, as the chaos driver restarts one (``--resume``): where its own state
comes from is ``core.restore.Resume``'s decision, the same code as the runtime's, and each of its actions
is carried out on memory instead of a store and the network (``sim.effects.LearnerFx``, with these methods):

- ``LoadPart``/``InstallPart``: its own part of the snapshot the syncer resumed from (kept in memory by
  ``_save_part`` with the tensors and info a real part holds): inner optimizer, residuals, data position;
- ``TakeUpPosition``: the data position the syncer kept from its latest metadata (``core.positions``);
- ``RecoverFromPeer``: a healthy peer's state, the donor picked by ``core.recovery.Donations``.

Simplifications, all of time only: the donor's state is taken when it is asked (the runtime waits until
it has seen the versions the recipient saw; the recipient's replay covers the gap; with nobody healthy
yet it does not wait ``patience_s``), parts take no time to write or read.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco import tree
from wan_diloco.core.recovery import Candidate
from wan_diloco.core.restore import InstallPart, Resume
from wan_diloco.sim.effects import SyncerFx


def opt_digest(state) -> str:
    """SHA-256 of a train state's inner optimizer (names, dtypes, bytes), as the runtime's ``named_digest``."""
    h = hashlib.sha256()
    named = tree.to_named(state.opt_state, "opt")
    for name in sorted(named):
        a = np.asarray(named[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class ResumeReplay:
    """``Simulation``'s learner restarts (a mixin: it uses its learners, syncer, clock and event heap)."""

    def _restart(self, m: int) -> None:
        """Learner ``m`` came back holding Θ (joined): take up its own state as ``Resume`` says."""
        l = self.learners[m]
        run_id, _, resumed_from = self._identity_of_syncer()
        l.resume = Resume(m, True, self.spec.learner.peer_recovery, self.M, self.spec.syncer.donor_timeout_s)
        step = max(l.core.step, max(c.global_step for c in self._cores()))
        parts = tuple(sorted(self.learner_parts.get(m, {}))) if self.keepers else None
        l.position_known = False
        self._learner_actions(m, l.resume.on_joined(self.now, run_id, resumed_from, step, parts))
        l.position_known = True

    def _install_part(self, m: int, resume: Resume, a: InstallPart) -> list:
        """``InstallPart``: the inner optimizer, data position and residuals of the part, as the runtime's
        ``learner_state.install_part``."""
        l = self.learners[m]
        try:
            opt = tree.from_named(a.tensors, "opt", l.state.opt_state, "learner part")
            l.batches.restore(a.data)
            l.core.restore_feedback(a.tensors)
        except (ValueError, KeyError, TypeError) as e:
            return resume.on_part_failed(self.now, a.snapshot, a.fallback, str(e))
        l.state = l.state.replace(opt_state=jax.tree_util.tree_map(jnp.asarray, opt),
                                  step=jnp.asarray(max(a.train_step, l.core.step), jnp.int32))
        l.core.advance(a.step)
        l.tokens = a.tokens
        return resume.on_installed(self.now, a.snapshot, a.fallback, l.core.step)

    def _recover_from_peer(self, m: int) -> dict:
        """``RecoverFromPeer``: the donor ``Donations`` picks gives its state (it takes ``state_bytes`` over the
        link); with none, the learner goes on from Θ. How it went, as the runtime's ``recover_from_peer``."""
        l = self.learners[m]
        candidates = {i: Candidate(p.core.region, p.core.step) for i, p in enumerate(self.learners)
                      if p.up and p is not l}
        self.recovery_outcome: dict = {"from_peer": False, "why": "not asked"}
        SyncerFx(self).run(self.donations.request(self.now, m, tuple(self.syncer.version), candidates, l.core.region))
        return self.recovery_outcome

    def send_donate(self, donor: int, recipient: int, versions: tuple[int, ...]) -> None:
        """``AskDonor``: the donor's parameters, inner optimizer and schedule position as one train state, the
        protocol state through the core, taken at once."""
        d, r = donor, recipient
        l, peer = self.learners[r], self.learners[d]
        l.state = peer.state
        l.core.adopt(*peer.core.export())
        self.donations.delivered(r, d)
        l.ready_s = self.now + self.state_bytes * 8 / (self.cfg.bandwidth_gbit_s * 1e9) + self.cfg.rtt_s
        self.recovery_outcome = {"from_peer": True, "donor": d, "opt_digest": opt_digest(l.state),
                                 "donor_opt_digest": opt_digest(peer.state)}

    def refuse_state_fetch(self, recipient: int, why: str) -> None:
        """``NoDonor``: the learner goes on from Θ."""
        l = self.learners[recipient]
        for p in range(len(self.frags)):
            self._learner_actions(recipient, l.core.resync(p, self.syncer.theta[p], self.syncer.version[p]))
        self.recovery_outcome = {"from_peer": False, "why": why}

    def _save_part(self, m: int, snapshot: int) -> None:
        """``SaveState``: the learner's part of ``snapshot``, the tensors and info a real part holds (the core's
        protocol state, the inner optimizer, train step, tokens, data position), kept in memory for as many
        snapshots as a store keeps (``checkpoint.keep``); the syncer hears of it in its next metadata."""
        l = self.learners[m]
        tensors, info = l.core.export()
        tensors.update(tree.to_named(l.state.opt_state, "opt"))
        info.update(train_step=int(l.state.step), snapshot=snapshot, tokens=l.tokens, data=l.batches.position())
        parts = self.learner_parts.setdefault(m, {})
        parts[snapshot] = (tensors, info)
        for old in sorted(parts)[:-self.spec.checkpoint.keep]:
            del parts[old]
        l.core.saved(snapshot)
