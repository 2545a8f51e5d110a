"""The simulator's effects (``core.effects``): what each action of the cores does on the virtual clock.

``SimEffects`` (a mixin of ``Simulation``) holds them: learner ``m``'s as ``learner_<effect>(m, ...)``,
the syncer's as the ``SyncerEffects`` names (those of peer recovery in ``sim.donations``, of the start barrier
in ``sim.start_end``). ``LearnerFx`` binds one learner, ``SyncerFx`` the syncer and, for the actions of a
snapshot coordinator, its ``SnapshotKeeper`` (the parts and manifests in memory): these are what
``core.effects.dispatch_learner`` / ``dispatch_syncer`` get. An effect the simulator does not replay raises
``NotImplementedError`` saying why (tests/core/test_effects.py keeps that list).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.core import FINAL_TIMER
from wan_diloco.core.effects import dispatch_learner, dispatch_syncer
from wan_diloco.core.peer import position_from_bytes

NO_FETCH = "the simulator resyncs a fragment from the syncer's memory at once, with no fetch to count"


class SimEffects:
    """``Simulation``'s effects (the module docstring); it uses its learners, syncer, clock and event heap."""

    # ---- learner m's ---------------------------------------------------------------------------

    def learner_send_metadata(self, m: int, msg) -> None:
        self._at(self.now + self.cfg.rtt_s / 2, self._from_learner, m, self.learners[m].life, self._metadata,
                 self._with_position(m, msg))

    def learner_send_fragment(self, m: int, msg) -> None:
        l = self.learners[m]
        self.bytes_sent += msg.nbytes
        if msg.final:  # the end-of-run sync happens after the clock stops
            self._syncer_event(self._upload, msg)
        else:
            self._at(l.up_link.send(self.now, msg.nbytes), self._from_learner, m, l.life, self._upload, msg)

    def learner_copy_fragment(self, m: int, fragment: int, due_step: int, final: bool) -> None:
        l = self.learners[m]
        flat = tree.flatten(l.state.params)
        theta = {n: np.asarray(flat[n]) for n in self.frags[fragment]}
        self._learner_actions(m, l.core.snapshot(self.now, fragment, due_step, theta, final))

    def learner_apply_fragment(self, m: int, update) -> None:
        l = self.learners[m]
        flat = tree.flatten(l.state.params)
        flat.update({n: jnp.asarray(v) for n, v in update.mixed(flat).items()})
        l.state = train_lib.set_params(l.state, tree.unflatten(flat, l.state.params))

    def learner_fetch_fragment(self, m: int, fragment: int) -> None:
        self.bytes_sent += sum(x.nbytes for x in self.syncer.theta[fragment].values())
        self._learner_actions(m, self.learners[m].core.resync(fragment, self.syncer.theta[fragment],
                                                                self.syncer.version[fragment]))

    def learner_rejoin(self, m: int, epoch: int, resumed_from: int) -> None:
        self._fetch_for_join(m)

    def learner_read_part(self, m: int, part) -> None:
        resume, snap = self.learners[m].resume, part.snapshot
        got = self.learner_parts.get(m, {}).get(snap)
        self._learner_actions(m, resume.on_part_failed(self.now, snap, part.fallback, "no such part") if got is None
                              else resume.on_part(self.now, snap, part.fallback, *got))

    def learner_fetch_position(self, m: int) -> None:
        l = self.learners[m]
        position = position_from_bytes(self.positions.of(m).encode())  # what ``position/M`` serves
        if position is not None:
            l.batches.restore(position)
        self.faults.append({"event": "data_position", "learner": m, "at_s": self.now,
                            "restored": position is not None, "batches": l.batches.drawn})

    def learner_fetch_peer_state(self, m: int, patience_s: float) -> None:
        self._ask_peer(m, self.learners[m].resume, patience_s)  # sim.donations: ``Resume.on_peer`` once it ended

    def learner_write_part(self, m: int, snapshot: int) -> None:
        self._save_part(m, snapshot)

    def learner_install_part(self, m: int, part) -> None:
        self._learner_actions(m, self._install_part(m, self.learners[m].resume, part))

    def learner_report(self, m: int, event) -> None:
        self.faults.append({**event, "at_s": self.now})

    def learner_send_state(self, m: int, recipient: int, versions: tuple[int, ...]) -> None:
        self._send_state(m, recipient, versions)  # sim.donations: its parts on the donor's up link

    def learner_count_resync(self, m: int, fragment: int, version: int) -> None:
        raise NotImplementedError(NO_FETCH)

    def learner_take_up_step(self, m: int) -> None:
        raise NotImplementedError(NO_FETCH)

    # ---- the syncer's ----------------------------------------------------------------------------

    def broadcast(self, msg) -> None:
        if msg.final:
            for m, l in enumerate(self.learners):
                if l.up:
                    self.bytes_sent += msg.nbytes
                    self._learner_actions(m, l.core.on_update(self.now, msg))
            return
        sent_s = self.syncer.ready_at(self.now, msg) if self.sharded else self.now
        for m, l in enumerate(self.learners):
            if l.listening:
                self.bytes_sent += msg.nbytes
                self._at(l.down_link.send(sent_s, msg.nbytes), self._deliver, m, l.life, msg)

    def set_timer(self, key: tuple[int, int], at_s: float) -> None:
        if key == FINAL_TIMER:
            return  # the end-of-run sync runs after the clock stops (``_final_sync``)
        shard = self.syncer.plan[key[0]] if self.sharded else 0
        self._at(at_s, self._timer, shard, self.syncer_life[shard], key)



class LearnerFx:
    """Learner ``m``'s ``LearnerEffects`` in ``sim``."""

    def __init__(self, sim: Any, m: int):
        self.sim, self.m = sim, m

    def run(self, actions: list) -> None:
        for a in actions:
            dispatch_learner(a, self)

    def send_metadata(self, msg) -> None:
        self.sim.learner_send_metadata(self.m, msg)

    def send_fragment(self, msg) -> None:
        self.sim.learner_send_fragment(self.m, msg)

    def send_state(self, recipient: int, versions: tuple[int, ...]) -> None:
        self.sim.learner_send_state(self.m, recipient, versions)

    def copy_fragment(self, fragment: int, due_step: int, final: bool) -> None:
        self.sim.learner_copy_fragment(self.m, fragment, due_step, final)

    def apply_fragment(self, update) -> None:
        self.sim.learner_apply_fragment(self.m, update)

    def fetch_fragment(self, fragment: int) -> None:
        self.sim.learner_fetch_fragment(self.m, fragment)

    def fetch_position(self) -> None:
        self.sim.learner_fetch_position(self.m)

    def fetch_peer_state(self, patience_s: float) -> None:
        self.sim.learner_fetch_peer_state(self.m, patience_s)

    def rejoin(self, epoch: int, resumed_from: int) -> None:
        self.sim.learner_rejoin(self.m, epoch, resumed_from)

    def write_part(self, snapshot: int) -> None:
        self.sim.learner_write_part(self.m, snapshot)

    def read_part(self, part) -> None:
        self.sim.learner_read_part(self.m, part)

    def install_part(self, part) -> None:
        self.sim.learner_install_part(self.m, part)

    def take_up_step(self) -> None:
        self.sim.learner_take_up_step(self.m)

    def count_resync(self, fragment: int, version: int) -> None:
        self.sim.learner_count_resync(self.m, fragment, version)

    def report(self, event) -> None:
        self.sim.learner_report(self.m, event)


class SyncerFx:
    """The syncer's ``SyncerEffects`` in ``sim``; with ``keeper``, those of its snapshot coordinator's actions
    (the parts and manifests it keeps in memory)."""

    def __init__(self, sim: Any, keeper: Any = None):
        self.sim, self.keeper = sim, keeper

    def run(self, actions: list) -> None:
        for a in actions:
            dispatch_syncer(a, self)

    def broadcast(self, msg) -> None:
        self.sim.broadcast(msg)

    def set_timer(self, key: tuple[int, int], at_s: float) -> None:
        self.sim.set_timer(key, at_s)

    def write_part(self, part) -> None:
        self.run(self.keeper.part_written(self.sim.now, part))

    def write_manifest(self, manifest) -> None:
        self.run(self.keeper.manifest_written(self.sim.now, manifest))

    def announce_snapshot(self, msg) -> None:
        self.keeper.announce(self.sim.now, msg)

    def snapshot_complete(self, done) -> None:
        self.keeper.completed(self.sim.now, done)

    def send_donate(self, donor: int, recipient: int, versions: tuple[int, ...]) -> None:
        self.sim.send_donate(donor, recipient, versions)

    def hold_state_fetch(self, recipient: int) -> None:
        self.sim.hold_state_fetch(recipient)

    def answer_state_fetch(self, recipient: int) -> None:
        self.sim.answer_state_fetch(recipient)

    def refuse_state_fetch(self, recipient: int, why: str) -> None:
        self.sim.refuse_state_fetch(recipient, why)

    def drop_state(self, recipient: int) -> None:
        self.sim.drop_state(recipient)

    def announce_barrier(self, status, met: bool) -> None:
        self.sim.announce_barrier(status, met)

    def fail(self, why: str) -> None:
        self.sim.fail(why)
