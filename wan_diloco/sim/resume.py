"""A learner's restart in the simulator, as the chaos driver restarts one (``--resume``): where its own state
comes from is ``core.restore.Resume``'s decision, the same code as the runtime's, and each of its actions
is carried out on memory instead of a store and the network (``sim.effects.LearnerFx``, with these methods):

- ``LoadPart``/``InstallPart``: its own part of the snapshot the syncer resumed from (kept in memory by
  ``_save_part`` with the tensors and info a real part holds): inner optimizer, residuals, data position;
- ``TakeUpPosition``: the data position the syncer kept from its latest metadata (``core.positions``);
- ``RecoverFromPeer``: a healthy peer's state, asked of the syncer and sent by the donor through the
  runtime's core pieces (``sim.donations``); the learner trains again once that request ended.

Simplification, of time only: parts take no time to write or read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from wan_diloco import tree
from wan_diloco.core.peer import named_digest
from wan_diloco.core.restore import InstallPart, Resume


def opt_digest(state) -> str:
    """SHA-256 of a train state's inner optimizer (names, dtypes, bytes): ``core.peer.named_digest``."""
    return named_digest(tree.to_named(state.opt_state, "opt"), "opt/")


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
