"""Peer recovery in the simulator (docs/method.md, "Recovery"), both sides through the core pieces the
runtime uses, each message on its simulated link:

- the recipient (``core.restore.Resume`` said ``RecoverFromPeer``) sends metadata flagged ``recovering``;
  the syncer's ``core.recovery.Donations`` asks a donor (``AskDonor``) or says there is none (``NoDonor``);
- the donor hears ``Donate`` on its update stream; its ``core.peer.Donor`` answers between two steps once
  it has seen the versions the recipient saw (``SendState``): its state (``core.peer.state_tensors``, the
  runtime's ``donation`` state file) travels as ``core.recovery.donation_parts`` on its up link, and
  ``Donations.on_part`` reassembles them (``StateReady``; a part of a replaced donor is refused);
- the recipient's fetch wakes, the state crosses its down link and is installed as the runtime's
  ``recover_from_peer`` does (parameters, inner optimizer, ``LearnerCore.adopt``, the step taken up); the
  updates that arrived meanwhile are replayed; ``Resume.on_peer`` hears how it went;
- a donor that dies is replaced at once (its stream ends: ``Donations.on_peer_lost``), one silent for
  ``syncer.donor_timeout_s`` at the syncer's next tick (``run.tick_s``); a recipient told that nobody is
  healthy asks again while its patience lasts (``core.peer.PeerRequest``), as the runtime's.

Simplifications: the recipient's fetch waits as long as ``Donations`` takes (the runtime's gives up at
``core.peer.peer_wait_s``; ``Donations`` always ends, with a state or ``NoDonor``); a syncer (or its shard
0) that dies ends every recovery in progress, and one that is down refuses a new one (the recipients go on
from Θ, as the runtime's fetch fails).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from wan_diloco import tree
from wan_diloco.checkpoint import CheckpointError, decode_state, encode_state
from wan_diloco.core.peer import PeerRequest, named_digest, state_tensors
from wan_diloco.core.protocol import ProtocolError
from wan_diloco.core.recovery import (
    DONATION_PART_BYTES, DonatedState, Donations, PartRefused, donation_parts, max_state_bytes,
)
from wan_diloco.core.restore import Resume
from wan_diloco.sim.effects import SyncerFx


@dataclass
class Recovering:
    """A recipient's request for a peer's state, from its ask to ``Resume.on_peer``."""

    resume: Resume
    request: PeerRequest
    buffered: list = dataclasses.field(default_factory=list)  # updates that arrived meanwhile, in order


class PeerRecovery:
    """``Simulation``'s peer recovery (a mixin: it uses its learners, syncer, clock and event heap)."""

    def _new_donations(self) -> Donations:
        return Donations(self.spec.syncer.donor_timeout_s, max_state_bytes(sum(self.parts.layout.nbytes)))

    def _donors(self, now_s: float) -> dict:
        core = self._cores()[0]  # peer recovery is shard 0's, as in the runtime
        return self.donations.candidates(now_s, core.learners, core.quarantined, self._regions())

    def _regions(self) -> dict[int, str]:
        return {m: l.core.region for m, l in enumerate(self.learners)}

    # ---- the recipient ------------------------------------------------------------------------

    def _ask_peer(self, m: int, resume: Resume, patience_s: float) -> None:
        """``RecoverFromPeer``: metadata flagged ``recovering`` asks the syncer; the answer comes as events."""
        l = self.learners[m]
        l.recovery = Recovering(resume, PeerRequest(self.now, patience_s, math.inf))
        if self.syncer_up[0]:
            self._send_recovering(m)
        else:  # nobody to ask: refused as the runtime's fetch fails (one that dies meanwhile: ``_drop_recoveries``)
            self._at(self.now + self.cfg.rtt_s / 2, self._refused_peer, m, l.life, "the syncer is down")

    def _send_recovering(self, m: int) -> None:
        l = self.learners[m]
        msg = dataclasses.replace(self._with_position(m, l.core.metadata()), recovering=True)
        self._at(self.now + self.cfg.rtt_s / 2, self._from_learner, m, l.life, self._metadata, msg)

    def _answer(self, r: int) -> None:
        """The recipient's fetch of ``donation/M`` wakes at the syncer: the state crosses its down link, or
        the refusal (why there is none) comes back."""
        l = self.learners[r]
        if l.recovery is None:
            return
        got = self.donations.lookup(r)
        if isinstance(got, DonatedState):
            data = bytes(got.data)
            self.bytes_sent += len(data)
            self._at(l.down_link.send(self.now, len(data)), self._install_peer, r, l.life, data)
        elif got is not None:
            self._at(self.now + self.cfg.rtt_s / 2, self._refused_peer, r, l.life, got.why)

    def _refused_peer(self, r: int, life: int, why: str) -> None:
        l = self.learners[r]
        if life != l.life or l.recovery is None:
            return
        again = l.recovery.request.on_refused(self.now, why)
        if again is None:
            self._peer_done(r, {"from_peer": False, "why": why})
        else:
            self._at(self.now + again.after_s, self._ask_again, r, l.life, again.resend_metadata)

    def _ask_again(self, r: int, life: int, resend_metadata: bool) -> None:
        if life == self.learners[r].life and self.learners[r].recovery is not None:
            self._send_recovering(r) if resend_metadata else self._answer(r)

    def _install_peer(self, r: int, life: int, data: bytes) -> None:
        """The donor's state arrived: install it as the runtime's ``recover_from_peer``."""
        l = self.learners[r]
        if life != l.life or l.recovery is None:
            return
        try:
            tensors, info = decode_state(data, "donation", what="peer state")
            params = tree.from_named(tensors, "params", l.state.params, "peer state")
            opt = tree.from_named(tensors, "opt", l.state.opt_state, "peer state")
            l.core.adopt(tensors, info)
        except (CheckpointError, ProtocolError, ValueError, KeyError) as e:
            self._peer_done(r, {"from_peer": False, "why": str(e)})
            return
        l.state = l.state.replace(params=jax.tree_util.tree_map(jnp.asarray, params),
                                  opt_state=jax.tree_util.tree_map(jnp.asarray, opt))
        # The donor's optimizer as it came, bit for bit; only its schedule position moves (take-up of the step).
        digest = named_digest(tree.to_named(l.state.opt_state, "opt"), "opt/")
        l.core.advance(int(info.get("train_step", 0)))
        self._take_up_step(r)
        self._peer_done(r, {"from_peer": True, "donor": info.get("donor"), "bytes": len(data), "opt_digest": digest,
                            "replayed": len(l.recovery.buffered)})

    def _peer_done(self, m: int, recovery: dict) -> None:
        """The request ended: replay what arrived meanwhile, tell ``Resume``, train again once ready."""
        l = self.learners[m]
        rec, l.recovery = l.recovery, None
        if not recovery["from_peer"]:  # it goes on from Θ (the runtime's restarted learner joined it)
            for p in range(len(self.frags)):
                self._learner_actions(m, l.core.resync(p, self.syncer.theta[p], self.syncer.version[p]))
        for msg in rec.buffered:  # those the donor had applied already are ignored by on_update
            self._learner_actions(m, l.core.on_update(self.now, msg))
        self._learner_actions(m, rec.resume.on_peer(self.now, recovery, l.core.step))
        self._at(max(self.now, l.ready_s), self._rejoin, m, l.life)

    def _drop_recoveries(self) -> None:
        """The syncer (its shard 0) died: its donations die with it, and each recipient's fetch fails."""
        self.donations = self._new_donations()
        for m, l in enumerate(self.learners):
            if l.recovery is not None:
                self._peer_done(m, {"from_peer": False, "why": "the syncer went away"})

    # ---- the donor ----------------------------------------------------------------------------

    def _donate(self, d: int, life: int, recipient: int, versions: tuple[int, ...]) -> None:
        """``Donate`` reached learner ``d``'s update stream (lost with a donor that died meanwhile)."""
        l = self.learners[d]
        if life != l.life:
            return
        l.donor.on_donate(self.now, recipient, versions)
        if not l.stepping:
            self._serve_donations(d)

    def _serve_donations(self, d: int) -> None:
        """Between two steps, as the runtime's inbox: send the states it can serve now."""
        l = self.learners[d]
        if not l.donor.asked or l.recovery is not None:
            return
        self._learner_actions(d, l.donor.on_versions(self.now, list(l.core.version)))  # SendState: _send_state

    def _send_state(self, d: int, recipient: int, versions: tuple[int, ...]) -> None:
        """``SendState``: the donor's state as the runtime's ``send_state`` encodes it, part by part on its up link."""
        l = self.learners[d]
        tensors, info = state_tensors(l.core, l.state.params, l.state.opt_state, l.state.step)
        info.update(donor=d)
        data = encode_state(tensors, info, "donation")
        self.faults.append({"event": "donated", "learner": d, "recipient": recipient, "at_s": self.now,
                            "bytes": len(data), "opt_digest": named_digest(tensors, "opt/"), "step": l.core.step,
                            "versions": list(versions)})
        part_bytes = min(DONATION_PART_BYTES, self.spec.transport.max_message_bytes // 2)
        for msg, payload in donation_parts(recipient, versions, data, part_bytes):
            self.bytes_sent += len(payload)
            self._at(l.up_link.send(self.now, len(payload)), self._part_arrives, d, l.life, msg, bytes(payload))

    # ---- the syncer ---------------------------------------------------------------------------

    def _part_arrives(self, d: int, life: int, msg, payload: bytes) -> None:
        if life != self.learners[d].life or not self.syncer_up[0]:
            return  # lost with its donor's connection, or with the syncer
        try:
            actions = self.donations.on_part(self.now, d, msg.recipient, msg.offset, msg.total_bytes, msg.digest,
                                             payload)
        except PartRefused as e:  # a replaced donor's: the runtime's Upload is refused alike
            self.faults.append({"event": "donation_refused", "learner": d, "recipient": msg.recipient,
                                "at_s": self.now, "why": str(e)})
            return
        self._donation_actions(actions)

    def _recovering_or_not(self, now_s: float, msg) -> None:
        """A learner's metadata (peer recovery is shard 0's): flagged ``recovering`` it asks for a state; not
        flagged, the state kept for it goes."""
        if self.syncer_up[0]:
            region, versions = self.learners[msg.learner].core.region, tuple(self.syncer.version)
            self._donation_actions(self.donations.on_metadata(now_s, msg.learner, msg.recovering, versions,
                                                              self._donors(now_s), region))

    def _donor_or_recipient_lost(self, now_s: float, m: int) -> None:
        if self.syncer_up[0]:
            self._donation_actions(self.donations.on_peer_lost(now_s, m, self._donors(now_s), self._regions()))

    def _donations_tick(self) -> None:
        self.donation_tick_due = False
        if self.syncer_up[0]:
            self._donation_actions(self.donations.on_tick(self.now, self._donors(self.now), self._regions()))
        self._tick_later()

    def _tick_later(self) -> None:
        """The syncer's liveness tick, while a donor is at work (``Donations.on_tick`` replaces a silent one)."""
        if self.donations.pending and not self.donation_tick_due:
            self.donation_tick_due = True
            self._at(self.now + self.spec.run.tick_s, self._donations_tick)

    def _donation_actions(self, actions: list) -> None:
        SyncerFx(self).run(actions)
        self._tick_later()

    # ``Donations``' actions (``core.effects.SyncerEffects``), through ``_donation_actions``.

    def send_donate(self, donor: int, recipient: int, versions: tuple[int, ...]) -> None:
        self.faults.append({"event": "ask_donor", "learner": recipient, "donor": donor, "at_s": self.now})
        self._at(self.now + self.cfg.rtt_s / 2, self._donate, donor, self.learners[donor].life, recipient, versions)

    def answer_state_fetch(self, recipient: int) -> None:
        self._answer(recipient)

    def refuse_state_fetch(self, recipient: int, why: str) -> None:
        self._answer(recipient)  # the fetch reads why from ``Donations.lookup``

    def hold_state_fetch(self, recipient: int) -> None:
        pass  # the runtime's waiter for the fetch: here the fetch is an event

    def drop_state(self, recipient: int) -> None:
        pass
