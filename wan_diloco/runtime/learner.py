"""A networked learner: jitted inner steps on this thread, the network on a ``NetThread``.

Between steps it merges what arrived (``LearnerCore.on_update``), and after a
step it copies the fragment due to host memory and hands the upload to the
network thread. It only waits on the network where the protocol says so
(``LearnerCore.blocked``), at (re)join (it fetches the current global
parameters from the syncer) and at the end (the final full sync).

When the syncer announces a snapshot, the learner copies its state to host
memory between steps (the only pause) and a writer thread stores its part;
with ``resume`` it takes up its part of the snapshot the syncer resumed from
(inner optimizer, data position, counters). A syncer that comes back as a new
incarnation from a snapshot is rejoined; one of another run, or restarted
without a snapshot, stops the learner (``IncarnationError``), as does a
final model that differs from the syncer's.

A learner of ``learner.hosts`` = P > 1 processes (``runtime.multihost``) runs
this loop in process 0, the leader, which also sends its followers a lockstep
header before each of its collective computations (``Lockstep``); the
followers run :func:`lockstep.run_follower` and never touch the network. With P = 1
none of that exists.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import queue
import signal
import sys
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.assemble import Assembly, fragment_digest
from wan_diloco.checkpoint import CheckpointError, SnapshotStore, decode_state, encode_state
from wan_diloco.config import ConfigError
from wan_diloco.planning import LinkEstimate, confirmed_move, replan_reasons, tau_for_link
from wan_diloco.fragments import tau_bounds
from wan_diloco.core.barrier import BarrierView
from wan_diloco.core import (
    ApplyGlobal, IncarnationError, ProtocolError, Rejoin, Resync, SaveState, SendFragment, SendMetadata, Snapshot,
    learner_node,
)
from wan_diloco.runtime import lockstep as lk
from wan_diloco.runtime import multihost as mh
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.netthread import NetThread
from wan_diloco.spec import RunSpec
from wan_diloco.transport import MessageError, TransportError
from wan_diloco.transport.reach import Diagnosis, diagnose


REPLAN_MIN_STEPS = 5  # steps timed before τ is planned from a link (τ counts steps)
JOIN_TRIES = 3
# A multi-process learner's leader tells its followers it lives at least this often while it waits on
# the network (they wait in the next header broadcast; a follower that died is noticed then too).
HEARTBEAT_S = 5.0


class SyncerLost(RuntimeError):
    """The syncer stayed unreachable for longer than the transport's retry budget."""


class StartTimeout(RuntimeError):
    """The start barrier was not met within run.start_timeout_s; the text names who never joined."""


class Stopped(Exception):
    """A signal asked the learner to stop while it waited on the network."""


class Learner:
    def __init__(self, cfg: RunSpec, learner: int, target: str, token: str, parts: Assembly | None = None,
                 resume: bool = False, lockstep: lk.Lockstep | None = None):
        """``lockstep``: this is the leader of a multi-process learner (``parts`` on the global mesh)."""
        self.cfg, self.m = cfg, learner
        self.region = cfg.region(learner)
        parts = parts or Assembly(cfg, learner)
        self.fingerprint = parts.fingerprint  # with every metadata: the syncer refuses other settings
        self.state = parts.state0
        self.layout = parts.layout
        self.codec = parts.codec
        self.core = parts.learner_core(learner)
        self.step_fn = parts.step_fn
        self.batches = parts.batches(learner)
        self.ls = lockstep
        self.evaluate = lambda: parts.evaluate(self.state.params)
        self.evaluate_params = parts.evaluate
        if lockstep is not None:
            self.evaluate = self._evaluate_together
        self.target = target
        # Room for a few rounds of every fragment's update between two steps, and never less than 64 MiB.
        self.net = NetThread(target, token, cfg.transport, learner_node(learner), self.region, self.codec,
                             parts.bulk_codec, inbox_bytes=max(4 * sum(self.layout.nbytes), 64 << 20))
        self.stop = threading.Event()
        self.pending_resync: dict[int, concurrent.futures.Future] = {}
        self.tokens = 0
        self.loss = float("nan")  # the latest training loss
        self.compute_s = 0.0
        self.raw_bytes = 0  # fp32 size of what was uploaded: numerator of the compression ratio
        self.payload_bytes = 0
        self.resyncs = 0
        self.link = None  # the latest LinkSample
        self.planned_link: LinkEstimate | None = None  # the link the current τ was planned for
        self.unplanned: LinkEstimate | None = None  # a sample that came before the step time was known
        self.recent_links: collections.deque[LinkEstimate] = collections.deque(maxlen=cfg.plan.replan_confirm)
        self.uploads = 0
        self.resume = resume
        self.store = SnapshotStore(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"learner-{learner}-snapshot")
        self.snapshot_stall_s = 0.0  # longest pause of training to copy a snapshot part to host
        self.snapshots_written = 0
        self.rejoins = 0
        self.donating: dict[int, tuple[int, ...]] = {}  # recipient -> versions it saw (peer recovery)
        self.recovery: dict | None = None  # how this learner's own recovery from a peer went
        # Until it knows where its data stream is (its own part, the syncer's copy, or a fresh run), its
        # metadata carries no position: the join's would replace the one the syncer keeps for it.
        self.position_known = False
        self.on_compiled = lambda: None  # called once the first step compiled (signal handlers go in then)
        self.barrier = BarrierView(cfg.run.start_timeout_s)  # the syncer's word on the start barrier
        if cfg.run.run_id:
            self.core.run_id = cfg.run.run_id  # a syncer serving another run is refused at the join

    # ---- actions --------------------------------------------------------------------

    def _handle(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, ApplyGlobal):
                flat = tree.flatten(self.state.params)
                # A multi-process leader mixes on the host: a jax op on the global arrays here would run
                # on its own devices only, a computation its followers never join.
                current = flat if self.ls is None else {n: np.asarray(flat[n]) for n in a.values}
                flat.update({n: jnp.asarray(v) for n, v in a.mixed(current).items()})
                self.state = train_lib.set_params(self.state, tree.unflatten(flat, self.state.params))
            elif isinstance(a, Snapshot):
                flat = tree.flatten(self.state.params)
                theta = {n: np.asarray(flat[n]) for n in self.layout.fragments[a.fragment]}
                self._handle(self.core.snapshot(time.monotonic(), a.fragment, a.due_step, theta, a.final))
            elif isinstance(a, SendFragment):
                self.raw_bytes += self.layout.nbytes[a.msg.fragment]
                self.payload_bytes += a.msg.nbytes
                self.uploads += 1
                self.net.upload(a.msg)
            elif isinstance(a, SendMetadata):
                self._send_metadata(a.msg)
            elif isinstance(a, Resync):
                if a.fragment not in self.pending_resync:
                    self.pending_resync[a.fragment] = self.net.fetch_fragment(f"fragment/{a.fragment}")
            elif isinstance(a, Rejoin):
                self._rejoin(a.epoch, a.resumed_from)
            elif isinstance(a, SaveState):
                self._save_part(a.snapshot)

    def _install(self, got) -> None:
        """A fragment fetched after a version gap (``Resync``)."""
        which = self.core.identity(got.run_id, got.epoch, got.resumed_from)
        if which == "new":  # the syncer came back from a snapshot while we fetched
            self._rejoin(got.epoch, got.resumed_from)
            return
        p, version = got.fragment, got.version
        if which == "same" and version > self.core.version[p]:
            self.resyncs += 1
            self._handle(self.core.resync(p, got.values, version, got.global_step))
        self._take_up_step()

    def _take_up_step(self) -> None:
        """A (re)joining or resynced learner takes up the global step: its step counter and its
        learning-rate schedule. A fresh inner optimizer (no peer state, or peer recovery off) would
        otherwise warm up again and train at the peak rate while the others have decayed."""
        if self.core.step > int(self.state.step):
            self.state = self.state.replace(step=jnp.asarray(self.core.step, jnp.int32))
        if self.core.step > int(train_lib.schedule_step(self.state)):
            self.state = train_lib.set_schedule_step(self.state, self.core.step)

    def _wait(self, fut: concurrent.futures.Future, timeout_s: float):
        """``fut.result(timeout_s)``, but a stop signal ends the wait (``Stopped``) at once."""
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            try:
                return fut.result(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        fut.cancel()
        raise Stopped()

    def _rejoin(self, epoch: int, resumed_from: int) -> None:
        emit({"event": "rejoin", "role": "learner", "learner": self.m, "step": self.core.step,
              "why": f"the syncer resumed from snapshot {resumed_from} as incarnation {epoch}"})
        self.join(self.cfg.transport.call_timeout_s + self.cfg.transport.retry_budget_s)
        self.rejoins += 1

    # ---- snapshots ------------------------------------------------------------------

    def _save_part(self, snap: int) -> None:
        """Copy this learner's state to host (training pauses only for this) and write it in the background."""
        if self.store is None:
            return
        t0 = time.monotonic()
        tensors, info = self._state_on_host()
        info.update(snapshot=snap, tokens=self.tokens, data=self.batches.position())
        self.snapshot_stall_s = max(self.snapshot_stall_s, time.monotonic() - t0)
        fut = self.writer.submit(self.store.save_part, snap, f"learner-{self.m}", tensors, info, "learner")
        fut.add_done_callback(lambda f: self.net.inbox.put(("saved", (snap, f))))

    # ---- peer recovery --------------------------------------------------------------

    def _state_on_host(self) -> tuple[dict, dict]:
        """Host copies of what a snapshot part and a donation both hold: the core's protocol state,
        parameters and inner optimizer (the one pause of training either causes)."""
        tensors, info = self.core.export()
        tensors.update(tree.to_named(self.state.params, "params"))
        tensors.update(tree.to_named(self.state.opt_state, "opt"))
        info.update(train_step=int(self.state.step))
        return tensors, info

    def _serve_donations(self) -> None:
        """Send this learner's state to recipients whose versions V it has seen (it keeps training: only
        the copy to host happens here, encoding and upload run on the writer thread)."""
        for r, versions in list(self.donating.items()):
            if len(versions) != len(self.core.version) or any(v < w for v, w in zip(self.core.version, versions)):
                continue  # not seen V yet: after a later update
            del self.donating[r]
            tensors, info = self._state_on_host()
            info.update(donor=self.m)

            def send(tensors=tensors, info=info, r=r, versions=versions):
                data = encode_state(tensors, info, "donation")
                part_bytes = min(serde.DONATION_PART_BYTES, self.cfg.transport.max_message_bytes // 2)
                for frame in serde.donation_frames(self.m, r, versions, data, part_bytes):
                    self.net.upload_frame(frame).result()  # in order: the syncer appends each part
                return len(data), named_digest(tensors, "opt/")

            fut = self.writer.submit(send)
            fut.add_done_callback(lambda f, r=r: self.net.inbox.put(("donated", (r, f))))

    def _send_metadata(self, msg, recovering: bool = False) -> None:
        """Metadata with this learner's data position, which the syncer hands back if it comes back
        without its own snapshot part (``_take_up_data_position``)."""
        position = json.dumps(self.batches.position(), separators=(",", ":")) if self.position_known else ""
        if len(position) > serde.MAX_STR_CHARS:  # never for the built-in streams; a custom one just loses it
            position = ""
        loss = self.loss if math.isfinite(self.loss) else None  # a diverged step is the syncer's to see, not a crash
        self.net.send_metadata(dataclasses.replace(msg, data=position, recovering=recovering, loss=loss,
                                                   tokens=self.tokens, fingerprint=self.fingerprint))

    def _take_up_data_position(self) -> None:
        """(Re)joined a run in progress without its own snapshot part: go on with the data stream where
        the syncer last saw it (its latest metadata), so its shard is not read again from the seed's
        first windows. What it drew after that metadata trained a state that died with it; those
        windows are drawn again, nothing is skipped."""
        try:
            text = bytes(self._wait(self.net.fetch_bytes(f"position/{self.m}"), self.cfg.transport.call_timeout_s))
            if not text:
                emit({"event": "data_position", "role": "learner", "learner": self.m, "restored": False,
                      "why": "the syncer has not seen this learner's data position"})
                return
            self.batches.restore(json.loads(text.decode("utf-8")))
        except (TransportError, MessageError, ValueError, concurrent.futures.TimeoutError) as e:
            emit({"event": "warning", "role": "learner", "learner": self.m,
                  "what": f"data position not restored ({e or type(e).__name__}): the data stream starts from its seed"})
            return
        emit({"event": "data_position", "role": "learner", "learner": self.m, "restored": True,
              "batches": self.batches.drawn})

    def _recover_from_peer(self, patience_s: float = 0.0) -> bool:
        """(Re)joined without state of its own while others train: take a healthy peer's parameters,
        inner optimizer and residuals (the syncer picks the donor), then replay the updates that
        arrived meanwhile; True if it did. Without one (none healthy, timeout, a bad state) it goes on
        from Θ alone. ``patience_s``: while no peer is healthy yet (a whole run resuming: the peers are
        still taking up their own parts), ask again for this long."""
        t0 = time.monotonic()
        patient_until = t0 + patience_s
        state_bytes = sum(getattr(a, "nbytes", 0) for a in jax.tree_util.tree_leaves((self.state, self.core.base)))
        self._send_metadata(self.core.metadata(), recovering=True)
        # Each donor gets donor_timeout_s without progress; the state crosses two links (donor -> syncer ->
        # here), each at least at the transport's slowest planned rate.
        t = self.cfg.transport
        deadline = time.monotonic() + 2 * self.cfg.syncer.donor_timeout_s + t.call_timeout_s + \
            2 * t.upload_deadline_s(state_bytes)
        fut = None
        try:
            while True:  # the syncer answers UNAVAILABLE "still arriving" while a donor is at work: ask again
                fut = self.net.fetch_bytes(f"donation/{self.m}", serde.max_state_bytes(sum(self.layout.nbytes)))
                try:
                    data = self._wait(fut, max(0.0, deadline - time.monotonic()))
                    break
                except TransportError as e:
                    if "no healthy learner" in e.details and time.monotonic() < patient_until:
                        if self.stop.wait(1.0):
                            raise Stopped() from None
                        self._send_metadata(self.core.metadata(), recovering=True)  # the syncer asks again
                        continue
                    if "still arriving" not in e.details or time.monotonic() >= deadline:
                        raise
            tensors, info = decode_state(data, "donation", what="peer state")
            params = tree.from_named(tensors, "params", self.state.params, "peer state")
            opt = tree.from_named(tensors, "opt", self.state.opt_state, "peer state")
            self.core.adopt(tensors, info)
        except (TransportError, MessageError, ValueError, KeyError, concurrent.futures.TimeoutError) as e:
            if fut is not None:
                fut.cancel()
            self.recovery = {"from_peer": False, "why": str(e) or type(e).__name__}
            emit({"event": "warning", "role": "learner", "learner": self.m,
                  "what": f"no peer state ({self.recovery['why']})" + (
                      ": going on from the global parameters with a fresh inner optimizer" if not patience_s else "")})
            return False
        self.state = self.state.replace(params=jax.tree_util.tree_map(jnp.asarray, params),
                                        opt_state=jax.tree_util.tree_map(jnp.asarray, opt))
        # The donor's optimizer as it came, bit for bit; only its schedule position moves (_take_up_step).
        opt_digest = named_digest(tree.to_named(self.state.opt_state, "opt"), "opt/")
        self.core.step = max(self.core.step, int(info.get("train_step", 0)))
        self._take_up_step()
        replayed = self.net.inbox.qsize()
        self._drain()  # the updates that arrived while the state travelled, in the order they came
        self.recovery = {"from_peer": True, "donor": info.get("donor"), "bytes": len(data), "opt_digest": opt_digest,
                         "schedule_step": int(train_lib.schedule_step(self.state)),
                         "seconds": round(time.monotonic() - t0, 3), "replayed": replayed}
        emit({"event": "recovered", "role": "learner", "learner": self.m, "step": self.core.step, **self.recovery})
        return True

    def _restore_part(self, snap: int, fallback: bool = False) -> bool:
        """``--resume``: take up this learner's part of snapshot ``snap`` (the one the syncer resumed from).
        ``self.part_unusable`` says afterwards whether the part was missing or broken (then the state is
        recovered from a peer, or from an earlier part: ``_restore_earlier_part``). ``fallback``: ``snap``
        is such an earlier snapshot."""
        what = f"--resume: learner {self.m}"
        self.part_unusable = False
        if not snap or self.store is None:
            why = "the syncer started fresh, not from a snapshot" if not snap else "checkpoint.dir is empty"
            emit({"event": "warning", "role": "learner", "learner": self.m, "what": f"{what}: nothing to resume ({why})"})
            return False
        try:
            tensors, info = self.store.load_part(snap, f"learner-{self.m}", "learner")
            if info.get("run_id") != self.core.run_id or info.get("learner") != self.m:
                raise CheckpointError(f"the part is of run {info.get('run_id')!r}, learner {info.get('learner')}")
            lived_past = [i for i in self.store.ids() if i > snap and self.store.part(i, f"learner-{self.m}").exists()]
            if lived_past and not fallback:
                # The syncer resumed from this snapshot and this learner trained on past it (it wrote a part
                # of snapshot lived_past[-1]) before it died: its optimizer, residuals and data position in
                # snapshot `snap` are older than its peers' (the data since would be read again).
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"{what}: it trained past snapshot {snap} (it wrote a part of snapshot "
                              f"{lived_past[-1]}): recovering from a peer instead of going back"})
                return False
            opt = tree.from_named(tensors, "opt", self.state.opt_state, "learner part")
            self.batches.restore(info["data"])
            self.core.restore_feedback(tensors)
            train_step, step, tokens = int(info["train_step"]), int(info["step"]), int(info["tokens"])
        except (CheckpointError, ValueError, KeyError, TypeError) as e:
            self.part_unusable = True
            if not fallback:
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"{what}: no usable part of snapshot {snap} ({e}); recovering its state from a peer, "
                              f"else from an earlier snapshot's part"})
            return False
        self.state = self.state.replace(opt_state=jax.tree_util.tree_map(jnp.asarray, opt),
                                        step=jnp.asarray(max(train_step, self.core.step), jnp.int32))
        self.core.step = max(self.core.step, step)
        self.tokens = tokens
        emit({"event": "resumed", "role": "learner", "learner": self.m, "snapshot": snap, "step": self.core.step,
              **({"fallback": True} if fallback else {})})
        return True

    def _restore_earlier_part(self, snap: int) -> bool:
        """Its part of snapshot ``snap`` was missing or broken and no peer gave a state: the newest earlier part
        of its own that verifies (an older optimizer, residuals and data position: windows since are read
        again, none skipped) rather than a fresh state."""
        for earlier in reversed([i for i in self.store.ids() if i < snap]):
            if self.store.part(earlier, f"learner-{self.m}").exists() and self._restore_part(earlier, fallback=True):
                self.recovery = {"from_peer": False, "from_snapshot": earlier}
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"--resume: learner {self.m}: state taken from its part of the earlier snapshot "
                              f"{earlier} (its part of snapshot {snap} was unusable and no peer gave one)"})
                return True
        emit({"event": "warning", "role": "learner", "learner": self.m,
              "what": f"--resume: learner {self.m}: no peer state and no earlier part of its own: going on from the "
                      f"global parameters with a fresh inner optimizer and data order"})
        return False

    def _drain(self, block_s: float = 0.0) -> None:
        """Merge what arrived; with ``block_s`` wait that long for the first item."""
        while True:
            try:
                kind, item = self.net.take(block_s)
            except queue.Empty:
                break
            block_s = 0.0
            if kind == "update":
                arrived_s, update = item
                self._handle(self.core.on_update(arrived_s, update))
            elif kind == "identity":  # a (re)connected update stream: is it still the syncer we follow?
                if self.core.meet(item.run_id, item.epoch, item.resumed_from, item.process) == "new":
                    self._rejoin(item.epoch, item.resumed_from)
            elif kind == "barrier":
                self.barrier.on_status(item.started, item.need, item.joined, item.waiting_for)
            elif kind == "donate":
                if item.recipient != self.m:
                    self.donating[item.recipient] = item.versions
            elif kind == "link":
                self._on_link(item)
            elif kind == "channels":
                emit({"event": "transport", "role": "learner", "learner": self.m, "region": self.region,
                      "step": self.core.step, **item})
            elif kind == "donated":
                r, fut = item
                if fut.exception() is not None:
                    emit({"event": "warning", "role": "learner", "learner": self.m,
                          "what": f"could not send this learner's state to learner {r}: {fut.exception()}"})
                else:
                    nbytes, opt_digest = fut.result()
                    emit({"event": "donated", "role": "learner", "learner": self.m, "recipient": r,
                          "bytes": nbytes, "opt_digest": opt_digest, "step": self.core.step})
            elif kind == "saved":
                snap, fut = item
                if fut.exception() is not None:
                    emit({"event": "warning", "role": "learner", "learner": self.m,
                          "what": f"snapshot {snap}: could not write this learner's part: {fut.exception()}"})
                else:
                    self.core.saved(snap)
                    self.snapshots_written += 1
            elif kind == "refused":  # the syncer runs other settings: retrying cannot help
                raise SyncerLost(str(item))
            else:
                raise SyncerLost(f"learner {self.m}: {item}")
        silent = self.net.silent_s()
        limit_s = silent and self.cfg.transport.retry_budget_s + self.cfg.transport.call_timeout_s
        if silent is not None and silent[0] > limit_s:
            raise SyncerLost(f"no answer from the syncer for {silent[0]:.0f} s (transport.retry_budget_s + "
                             f"call_timeout_s = {limit_s:g} s); last error: {silent[1]}")
        if self.donating:
            self._serve_donations()
        for p, fut in list(self.pending_resync.items()):
            if not fut.done():
                continue
            del self.pending_resync[p]
            try:
                got = fut.result()
            except (TransportError, MessageError, ProtocolError) as e:
                # Not fatal: the version gap persists, so the next update asks again, and the
                # final sync fetches every fragment anyway.
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"fetch of fragment {p} failed, will ask again: {e}"})
                continue
            self._install(got)

    def _on_link(self, sample) -> None:
        """A link measurement: log it (the run's metrics JSONL), keep it, and re-plan τ if asked to."""
        self.link = sample
        emit({"event": "link", "role": "learner", "learner": self.m, "region": self.region, "step": self.core.step,
              **sample.to_event()})
        if self.cfg.plan.adapt_tau and sample.rate_gbit_s > 0:
            try:
                self._replan(LinkEstimate(sample.rate_gbit_s, sample.rtt_s))
            except ConfigError as e:  # a measurement the planner cannot use must not end the run
                emit({"event": "warning", "role": "learner", "learner": self.m, "what": f"no re-plan: {e}"})

    def _replan(self, link: LinkEstimate, fresh: bool = True) -> None:
        """τ = the smallest this link allows (``planning.tau_for_link``), when the link moved enough:
        beyond ``replan_threshold`` in ``replan_confirm`` probes in a row (``planning.confirmed_move``).

        Until a few steps are timed, the sample waits: τ is counted in steps."""
        if fresh:
            self.recent_links.append(link)
        step_s = self.core.step_s.value
        if step_s is None or self.core.step < REPLAN_MIN_STEPS:
            self.unplanned = link
            return
        self.unplanned = None
        plan = self.cfg.plan
        if self.planned_link is None:
            reasons = [f"first plan: rate {link.rate_gbit_s:.3g} Gbit/s, rtt {link.rtt_s * 1e3:.1f} ms measured"]
        else:
            moved = confirmed_move(self.planned_link, self.recent_links, plan.replan_threshold, plan.replan_confirm)
            if moved is None:
                return
            link = moved
            reasons = replan_reasons({self.region: self.planned_link}, {self.region: link}, plan.replan_threshold)
            if plan.replan_confirm > 1:
                reasons.append(f"seen in {plan.replan_confirm} probes in a row")
        self.planned_link = link
        _, cap = tau_bounds(self.cfg.learner.sync_every, self.cfg.learner.num_fragments, plan.max_tau)
        # What actually goes on the wire per fragment so far (compressed), else the codec's bound.
        frag_bytes = (self.payload_bytes / self.uploads if self.uploads
                      else max(self.codec.max_bytes(p) for p in range(len(self.layout.fragments))))
        tau = tau_for_link(frag_bytes, link, step_s, plan.margin, sync_s=0.0, max_tau=cap)
        if tau is None:
            tau = cap
            reasons.append(f"the round trip needs more than tau = {cap} steps; using {cap}")
        old = self.core.cfg.tau
        self.core.retune(tau)
        emit({"event": "replan", "role": "learner", "learner": self.m, "region": self.region, "step": self.core.step,
              "tau_old": old, "tau_new": tau, "step_s": round(step_s, 4), "fragment_bytes": int(frag_bytes),
              "reasons": reasons})

    # ---- the run --------------------------------------------------------------------

    def join(self, timeout_s: float):
        """Take up the syncer's global parameters (fresh start, rejoin, a resumed syncer); returns the
        first fragment fetched (its identity fields say which syncer incarnation it is)."""
        for _ in range(JOIN_TRIES):
            futs = [self.net.fetch_fragment(f"fragment/{p}") for p in range(len(self.layout.fragments))]
            got = [self._wait(fut, timeout_s) for fut in futs]
            if len({(g.run_id, g.epoch) for g in got}) == 1:
                break  # else the syncer restarted while we fetched: again
        else:
            raise SyncerLost(f"learner {self.m}: the syncer changed incarnation during each of {JOIN_TRIES} joins")
        self.pending_resync.clear()  # fetches of the old incarnation mean nothing now
        first = got[0]
        self._handle(self.core.join(first.run_id, first.epoch, first.resumed_from,
                                    [(g.values, g.version) for g in got], max(g.global_step for g in got)))
        self._take_up_step()
        return first

    def run(self) -> dict:
        self._reach_syncer()  # first: an unreachable syncer is said in seconds, not after a compile and a deadline
        # Compile before joining: the first step on a shared CPU can take longer than the liveness timeout.
        if self.ls is None:
            jax.block_until_ready(self.step_fn(self.state, self.batches.next().tokens))
        else:
            self._step_together(self.batches.next().tokens, lk.OP_COMPILE)
        self.on_compiled()
        self.net.start()
        try:
            return self._run()
        except Stopped:
            return {"event": "stopped", "role": "learner", "learner": self.m, "step": self.core.step}
        finally:
            self.writer.shutdown(wait=True)  # a part being written is finished, not torn
            self.net.stop()

    def _unreachable(self, t) -> str | None:
        """Why the syncer (or which of its shards) cannot be reached (a ``reach.Diagnosis``), or None."""
        for target in self.target.split(","):
            why = diagnose(target, t.tls, timeout_s=min(5.0, t.call_timeout_s))
            if why is not None:
                if "," in self.target:
                    lasting, why = why.lasting, Diagnosis(f"{target}: {why}")
                    why.lasting = lasting
                return why
        return None

    def _reach_syncer(self) -> None:
        """Before the first call: if the syncer cannot be reached, say why at once (one line naming the
        address and the cause), then try again with backoff for ``transport.retry_budget_s``; SyncerLost
        after that. gRPC alone would wait out a call deadline and say DEADLINE_EXCEEDED."""
        t = self.cfg.transport
        deadline, wait_s, said = time.monotonic() + t.retry_budget_s, t.backoff_initial_s, None
        while (why := self._unreachable(t)) is not None:
            if getattr(why, "lasting", False):  # TLS on one side only, a certificate not trusted: waiting won't help
                raise SyncerLost(f"cannot reach the syncer at {self.target}: {why}; not retried: the two sides' "
                                 "[transport.tls] disagree, which does not heal by waiting")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncerLost(f"cannot reach the syncer at {self.target}: {why}; gave up after "
                                 f"{t.retry_budget_s:g} s (transport.retry_budget_s)")
            if why != said:  # each new reason once, not a line per retry
                said = why
                print(f"learner-{self.m}: cannot reach the syncer at {self.target}: {why}; retrying for up to "
                      f"{left:.0f} s", file=sys.stderr, flush=True)
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"cannot reach the syncer at {self.target}: {why}"})
            if self.stop.wait(min(wait_s, max(left, 0.0))):
                raise Stopped()
            wait_s = min(2 * wait_s, t.backoff_max_s)

    def _run(self) -> dict:
        joined = self.join(self.cfg.transport.call_timeout_s + self.cfg.transport.retry_budget_s)
        self.part_unusable = False
        restored = self.resume and self._restore_part(joined.resumed_from)
        # At a run's start nobody has trained yet: there is no state worth copying.
        if not restored and self.core.step > 0:
            self._take_up_data_position()
            self.position_known = True
            # A resumed run's peers are taking up their own parts meanwhile: wait for one to be ready.
            patience_s = (self.cfg.syncer.donor_timeout_s if self.resume and joined.resumed_from
                          and self.cfg.run.learners > 1 else 0.0)
            recovered = self.cfg.learner.peer_recovery and self._recover_from_peer(patience_s)
            if not recovered and self.part_unusable and self.store is not None:
                self._restore_earlier_part(joined.resumed_from)
        self.position_known = True
        # Before the first metadata, which counts as this learner's join at the start barrier: a learner that
        # joined is ready to step at once (the eval's compile would otherwise hold it back behind its peers).
        initial_loss = self.evaluate()
        self._send_metadata(self.core.metadata())  # the hello: it carries this learner's settings
        hello_by = time.monotonic() + self.cfg.transport.call_timeout_s
        while not self.net.hello_answered.is_set() and time.monotonic() < hello_by and not self.stop.is_set():
            self._drain(block_s=0.05)  # refused settings stop the learner here, before its first step
        self._drain()
        self.net.start_probing()
        self._await_start()
        self._take_up_step()  # updates merged while it waited moved the global step on
        emit({"event": "start", "role": "learner", "learner": self.m, "region": self.region,
              "step": self.core.step, "schedule_step": int(train_lib.schedule_step(self.state)),
              "eval_loss": initial_loss, "bytes_sent": self.net.bytes_sent,
              "bytes_received": self.net.bytes_received})
        t_start, last_report, loss = time.monotonic(), 0.0, float("nan")
        while self.core.step < self.cfg.run.steps and not self.stop.is_set():
            self._drain()
            while self.core.blocked and not self.stop.is_set():
                self._drain(block_s=0.05)
            t0 = time.monotonic()
            batch = self.batches.next()
            self.core.begin_step(t0)
            if self.ls is None:
                self.state, metrics = self.step_fn(self.state, batch.tokens)
            else:
                self.state, metrics = self._step_together(batch.tokens, lk.OP_STEP)
            loss = self.loss = float(metrics["loss"])  # also waits for the step to finish
            if self.cfg.run.min_step_s:
                time.sleep(max(0.0, self.cfg.run.min_step_s - (time.monotonic() - t0)))
            t1 = time.monotonic()
            self.compute_s += t1 - t0
            self.tokens += batch.n_tokens
            self._handle(self.core.step_done(t1, batch.n_tokens))
            if self.unplanned is not None and self.core.step >= REPLAN_MIN_STEPS:
                self._replan(self.unplanned, fresh=False)
            self._maybe_eval()
            if t1 - last_report >= self.cfg.run.report_every_s:
                last_report = t1
                emit({"event": "step", "role": "learner", "learner": self.m, "step": self.core.step,
                      "loss": loss, "tokens": self.tokens, "bytes_sent": self.net.bytes_sent,
                      "bytes_received": self.net.bytes_received, "versions": list(self.core.version)})
        if self.stop.is_set():
            return {"event": "stopped", "role": "learner", "learner": self.m, "step": self.core.step}
        train_s = time.monotonic() - t_start
        emit({"event": "finishing", "role": "learner", "learner": self.m, "step": self.core.step,
              "train_s": train_s, "bytes_sent": self.net.bytes_sent, "bytes_received": self.net.bytes_received})
        # Before the final sync, whose merges come back with no steps trained in between.
        lag = self.core.merge_lag_steps / self.core.merge_lags if self.core.merge_lags else None
        report = self.final_sync()
        return {"event": "final", "role": "learner", "learner": self.m, "region": self.region,
                "steps": self.core.step, "tokens": self.tokens, "train_s": train_s, "compute_s": self.compute_s,
                "initial_eval_loss": initial_loss, "last_loss": loss, "raw_bytes": self.raw_bytes,
                "payload_bytes": self.payload_bytes, "bytes_sent": self.net.bytes_sent,
                "bytes_received": self.net.bytes_received, "resyncs": self.resyncs,
                "link": self.link.to_event() if self.link is not None else None, "tau": self.core.cfg.tau,
                "merge_lag_steps": lag, "run_id": self.core.run_id, "epoch": self.core.epoch,
                "rejoins": self.rejoins, "snapshots_written": self.snapshots_written,
                "snapshot_stall_s": self.snapshot_stall_s, "stale_updates": self.core.stale_updates,
                "recovery": self.recovery,
                **report}

    def _await_start(self) -> None:
        """The start barrier: take no step before the syncer says enough learners joined (at once for a
        learner that joins a run already started). Metadata every few seconds keeps it alive meanwhile."""
        said, last_md_s = None, time.monotonic()
        every_s = min(5.0, self.cfg.syncer.liveness_timeout_s / 3)
        while not self.stop.is_set():
            self._drain(block_s=0.1)
            now = time.monotonic()
            if not self.barrier.must_wait(now):
                if said is not None:
                    emit({"event": "barrier", "role": "learner", "learner": self.m, "started": True,
                          "need": self.barrier.need, "joined": list(self.barrier.joined), "waiting_for": []})
                return
            if self.barrier.expired(now):
                raise StartTimeout(self.barrier.failure())
            seen = (self.barrier.joined, self.barrier.waiting_for)
            if seen != said and self.barrier.need and self.m not in seen[1]:  # (not before its own join counted)
                said = seen
                emit({"event": "barrier", "role": "learner", "learner": self.m, "started": False,
                      "need": self.barrier.need, "joined": list(seen[0]), "waiting_for": list(seen[1])})
            if now - last_md_s >= every_s:
                last_md_s = now
                self._send_metadata(self.core.metadata())
        raise Stopped()

    def _maybe_eval(self) -> None:
        """Every ``run.eval_every_steps`` steps, one learner in turn evaluates the global model as it holds it (its
        global view Θ, not its local parameters): the run's eval curve (``eval`` events)."""
        every, step = self.cfg.run.eval_every_steps, self.core.step
        if not every or step % every or (step // every) % self.cfg.run.learners != self.m:
            return
        t0 = time.monotonic()
        flat = {n: v for fragment in self.core.base for n, v in fragment.items()}
        if self.ls is None:
            loss = float(self.evaluate_params(tree.unflatten(flat, self.state.params)))
        else:  # Θ is the leader's alone: it travels to the followers, then every process evaluates
            with self.ls.turn():
                self.state = self.ls.lead(lk.OP_EVAL_PARAMS, self.state)
                params = self.ls.share_params(tree.unflatten(flat, self.state.params), self.state.params)
                loss = float(self.evaluate_params(params))
        emit({"event": "eval", "role": "learner", "learner": self.m, "step": step, "eval_loss": loss,
              "versions": list(self.core.version), "tokens": self.tokens, "eval_s": round(time.monotonic() - t0, 3)})

    # ---- a multi-process learner's leader ----------------------------------------------

    def _step_together(self, tokens, op: int):
        """One step of every process: the header (with the batch and what the leader changed), then the
        step on each process's rows. ``OP_COMPILE`` keeps the old state (the step before the join)."""
        with self.ls.turn():
            self.state = self.ls.lead(op, self.state, tokens)
            state, metrics = jax.block_until_ready(self.step_fn(self.state, self.ls.feed(tokens)))
            if op == lk.OP_COMPILE:
                return self.state, metrics
            self.ls.stepped(state)
            return state, metrics

    def _evaluate_together(self) -> float:
        """The held-out loss of the parameters every process holds (an evaluation is a collective)."""
        with self.ls.turn():
            self.state = self.ls.lead(lk.OP_EVAL, self.state)
            return float(self.evaluate_params(self.state.params))

    def final_sync(self) -> dict:
        """Upload every fragment (flagged final); take the syncer's final fragments, by broadcast or bulk.

        A syncer that resumes from a snapshot meanwhile dropped these uploads (old incarnation): the
        learner rejoins it and syncs again."""
        for _ in range(JOIN_TRIES):
            report = self._final_sync_once()
            if report is not None:
                return report
        raise SyncerLost(f"learner {self.m}: the syncer changed incarnation during each of {JOIN_TRIES} final syncs")

    def _final_sync_once(self) -> dict | None:
        self._drain()
        rejoins = self.rejoins
        self._handle(self.core.finish())
        budget_s = self.cfg.syncer.final_timeout_s + self.cfg.transport.retry_budget_s
        self.net.wait_uploads(budget_s)
        futs = [self.net.fetch_fragment(f"final/{p}") for p in range(len(self.layout.fragments))]
        # Until the finals are served, keep reading the update stream: it says when the syncer came back
        # as a new incarnation (the identity frame; ``_drain`` rejoins it).
        deadline = time.monotonic() + budget_s
        while not all(f.done() for f in futs) and time.monotonic() < deadline and not self.stop.is_set():
            self._drain(block_s=0.1)
            if self.rejoins != rejoins:
                for f in futs:
                    f.cancel()
                return None
        if self.stop.is_set():
            raise Stopped()
        finals = [self._final_fragment(p, fut, budget_s) for p, fut in enumerate(futs)]
        if any(f.epoch != self.core.epoch for f in finals):  # served by an incarnation it has not joined
            self._rejoin(finals[0].epoch, finals[0].resumed_from)
            return None
        # The broadcast of the final merge normally arrives on the update stream; bulk is the fallback.
        deadline = time.monotonic() + 5.0
        while any(self.core.version[f.fragment] < f.version for f in finals) and time.monotonic() < deadline:
            self._drain(block_s=0.05)
        by_bulk = 0
        for f in finals:
            if self.core.version[f.fragment] < f.version:
                by_bulk += 1
                self._handle(self.core.resync(f.fragment, f.values, f.version))
        flat = {n: np.asarray(a) for n, a in tree.flatten(self.state.params).items()}
        digests = [fragment_digest(self.core.base[p], names) for p, names in enumerate(self.layout.fragments)]
        # The syncer's final fragments as served: a learner whose model drifted from them must not pass as done.
        mismatch = [f.fragment for f in finals
                    if fragment_digest(f.values, self.layout.fragments[f.fragment]) != digests[f.fragment]]
        return {
            "versions": list(self.core.version), "final_by_bulk": by_bulk, "digest_mismatch": mismatch,
            "digests": digests,
            "param_digests": [fragment_digest(flat, names) for names in self.layout.fragments],
            "final_eval_loss": self.evaluate(),
        }

    def _final_fragment(self, p: int, fut: concurrent.futures.Future, budget_s: float, tries: int = 3):
        """The syncer's final fragment p; a failed fetch is retried (a learner that gives up loses the run)."""
        for attempt in range(1, tries + 1):
            try:
                return fut.result(timeout=budget_s)
            except (TransportError, MessageError, ProtocolError) as e:
                if attempt == tries:
                    raise
                emit({"event": "warning", "role": "learner", "learner": self.m,
                      "what": f"fetch of final fragment {p} failed (try {attempt} of {tries}): {e}"})
                fut = self.net.fetch_fragment(f"final/{p}")


def named_digest(tensors: dict, prefix: str) -> str:
    """SHA-256 over the tensors whose names start with ``prefix`` (names, dtypes, bytes, in name order):
    equal digests on donor and recipient mean the state arrived bit for bit."""
    h = hashlib.sha256()
    for name in sorted(n for n in tensors if n.startswith(prefix)):
        a = np.asarray(tensors[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def run_learner(cfg: RunSpec, learner: int, target: str, token: str, resume: bool = False,
                parts: Assembly | None = None, lockstep: lk.Lockstep | None = None) -> int:
    """Process entry point: 0 after a completed final sync whose model equals the syncer's, 143 when
    stopped by a signal, 3 when the syncer was lost or is not the one this learner's model came
    from, 4 when the final model differs from the syncer's.

    With ``lockstep`` this is the leader of a multi-process learner: its followers are told to exit
    with the same status at the end, and a follower that died ends it with
    ``multihost.EXIT_JOB_BROKEN``."""
    lrn = Learner(cfg, learner, target, token, parts=parts, resume=resume, lockstep=lockstep)

    def stop_cleanly() -> None:
        # Until the first compile is done there is nothing to finish or write: a signal's default
        # action ends the process at once (a Python handler would wait for the compile, seconds).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: lrn.stop.set())

    lrn.on_compiled = stop_cleanly
    if lockstep is None:
        return _run_to_end(lrn, learner, target)
    lockstep.start_heartbeat(HEARTBEAT_S)
    code = 1  # what the followers are told if the leader fails otherwise (a bug: its traceback follows)
    try:
        code = _run_to_end(lrn, learner, target)
        return code
    except lk.JobBroken as e:
        emit({"event": "error", "role": "learner", "learner": learner,
              "error": f"the learner's job broke, another of its processes died or left: {e}"})
        lk.broken(lockstep.name, str(e))
        raise  # not reached: broken() ends the process
    finally:
        try:
            lockstep.stop(code)
        except lk.JobBroken as e:
            lk.broken(lockstep.name, str(e))


def _run_to_end(lrn: Learner, learner: int, target: str) -> int:
    try:
        result = lrn.run()
    except (IncarnationError, SyncerLost, StartTimeout, TransportError, MessageError) as e:  # not a bug: one line
        why = str(e)
        if isinstance(e, TransportError) and e.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            why = (f"the syncer at {target} refused this learner's token ({e.code.name}): {e.details}; "
                   f"$WAN_DILOCO_TOKEN must be the run's token or this learner's own (`wan-diloco token --learner "
                   f"{learner}` on the syncer's host), and with mutual TLS the certificate must be learner-{learner}'s")
        emit({"event": "error", "role": "learner", "learner": learner, "error": why})
        print(f"learner-{learner}: stopping: {why}", file=sys.stderr)
        return 3
    emit(result)
    if result.get("digest_mismatch"):
        print(f"learner-{learner}: final fragments {result['digest_mismatch']} differ from the syncer's", file=sys.stderr)
        return 4
    return 0 if result["event"] == "final" else 143


def run_multihost(cfg: RunSpec, learner: int, target: str, token: str, mcfg: mh.MultihostConfig,
                  resume: bool = False) -> int:
    """Process entry point of one process of a multi-process learner, once ``multihost.initialize`` has
    joined the job: process 0 leads (``run_learner``), the others follow (``run_follower``)."""
    mesh = mh.global_mesh()
    parts = Assembly(cfg, learner, mesh=mesh)
    who = f"learner-{learner}" + (f".p{mcfg.process_id}" if mcfg.process_id else "")
    lockstep = lk.Lockstep(mesh, parts.state0, (cfg.run.batch_size, cfg.model.seq_len + 1), mcfg.process_id,
                           mcfg.num_processes, name=f"{who} (process {mcfg.process_id} of {mcfg.num_processes})")
    try:
        lockstep.handshake()
    except lk.JobBroken as e:
        lk.broken(lockstep.name, str(e))
    if mcfg.leader:
        return run_learner(cfg, learner, target, token, resume=resume, parts=parts, lockstep=lockstep)
    return lk.run_follower(parts, lockstep)
