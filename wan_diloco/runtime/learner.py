"""A networked learner: jitted inner steps on this thread, the network on a ``NetThread``.

Between steps it merges what arrived (``LearnerCore.on_update``), and after a
step it copies the fragment due to host memory and hands the upload to the
network thread. It only waits on the network where the protocol says so
(``LearnerCore.blocked``), at (re)join (it fetches the current global
parameters from the syncer) and at the end (the final full sync).

An IO adapter: every protocol decision is the core's (``core.learner``, ``core.restore``,
``core.peer``, ``core.rejoin``, ``core.final_sync``) and ``handle`` carries out the actions
they return with ``core.effects.dispatch_learner`` (the effects: ``learner_effects``). The
IO of the learner's own state (snapshot parts, donations, peer recovery) is ``learner_state``,
of the final sync ``learner_final``; τ re-planning is ``replan``, exit statuses ``exits``, the process
entry points ``learner_main``.

A learner of ``learner.hosts`` = P > 1 processes (``runtime.multihost``) runs
this loop in process 0, the leader, which also sends its followers a lockstep
header before each of its collective computations (``lockstep``); the
followers run :func:`lockstep.run_follower` and never touch the network. With P = 1
none of that exists.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import queue
import threading
import time
import typing

import jax
import jax.numpy as jnp

from wan_diloco import train as train_lib
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.core import ProtocolError, learner_node
from wan_diloco.core import rejoin as rj
from wan_diloco.core.barrier import BarrierView
from wan_diloco.core.peer import Donor, position_field
from wan_diloco.core.messages import Barrier, Donate, Identity, SnapshotCut
from wan_diloco.core.restore import Resume
from wan_diloco.runtime import learner_state as ls_io
from wan_diloco.runtime import lockstep as lk
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.runtime import learner_eval, learner_join, learner_start
from wan_diloco.runtime.exits import StartTimeout, Stopped, SyncerLost
from wan_diloco.runtime.inbox import Arrived, ChannelsWidened, Donated, Refused, Saved, StreamLost
from wan_diloco.runtime.learner_effects import LearnerEffectsIO
from wan_diloco.runtime.learner_final import final_sync
from wan_diloco.runtime.learner_state import named_digest
from wan_diloco.runtime.netthread import NetThread
from wan_diloco.runtime.replan import Replanner
from wan_diloco.runtime.sync_worker import SyncWorker
from wan_diloco.spec import RunSpec
from wan_diloco.transport import LinkSample, MessageError, TransportError

# Names other modules import from here.
__all__ = ["Learner", "StartTimeout", "Stopped", "SyncerLost", "named_digest"]


class Learner(LearnerEffectsIO):
    sync: SyncWorker | None = None  # set in __init__ unless learner.sync_in_flight is 0

    def __init__(self, cfg: RunSpec, learner: int, target: str, token: str, parts: Assembly | None = None,
                 resume: bool = False, lockstep: lk.Lockstep | None = None):
        """``lockstep``: this is the leader of a multi-process learner (``parts`` on the global mesh)."""
        self.cfg, self.m = cfg, learner
        self.region = cfg.region(learner)
        parts = parts or Assembly(cfg, learner)
        self.fingerprint = parts.fingerprint  # with every metadata: the syncer refuses other settings
        self.state = parts.state0
        self.layout = parts.layout
        self.core = parts.learner_core(learner)
        self.step_fn = parts.step_fn
        self.batches = parts.batches(learner)
        self.ls = lockstep
        self.evaluate_params = parts.evaluate
        self.target = target
        # Room for a few rounds of every fragment's update between two steps, and never less than 64 MiB.
        self.net = NetThread(target, token, cfg.transport, learner_node(learner), self.region, parts.codec,
                             parts.bulk_codec, inbox_bytes=max(4 * sum(self.layout.nbytes), 64 << 20))
        self.stop = threading.Event()
        self.pending_resync: dict[int, concurrent.futures.Future] = {}
        self.tokens = 0
        self.loss = float("nan")  # the latest training loss
        self.compute_s = 0.0
        self.raw_bytes = 0  # fp32 size of what was uploaded: numerator of the compression ratio
        self.payload_bytes = 0
        self.resyncs = 0
        self.uploads = 0
        self.replanner = Replanner(cfg, learner, self.region,
                                   max(parts.codec.max_bytes(p) for p in range(len(self.layout.fragments))))
        self.resume = Resume(learner, resume, cfg.learner.peer_recovery, cfg.run.learners, cfg.syncer.donor_timeout_s)
        self.store = SnapshotStore(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"learner-{learner}-snapshot")
        self.snapshot_stall_s = 0.0  # longest pause of training to copy a snapshot part to host
        self.snapshots_written = 0
        self.rejoins = 0
        self.donor = Donor(learner)  # peer recovery: the states this learner was asked for
        # Until it knows where its data stream is (its own part, the syncer's copy, or a fresh run), its
        # metadata carries no position: the join's would replace the one the syncer keeps for it.
        self.position_known = False
        self.on_compiled = lambda: None  # called once the first step compiled (signal handlers go in then)
        self.barrier = BarrierView(cfg.run.start_timeout_s)  # the syncer's word on the start barrier
        if cfg.run.run_id:
            self.core.follow_run(cfg.run.run_id)  # a syncer serving another run is refused at the join
        # Snapshots finished off the training thread; a multi-process leader keeps them on it (its host
        # copies of global arrays stay beside its collectives), as does eager (its stand-in comes with them).
        self.sync = (SyncWorker(self.core, lambda msg: self.net.upload(msg), cfg.learner.sync_in_flight,
                                f"learner-{learner}-sync", on_sent=self.count_upload)
                     if cfg.learner.sync_in_flight and lockstep is None and not cfg.learner.eager else None)

    def take_up_step(self) -> None:
        """Take up the global step: the step counter and the learning-rate schedule (``rejoin.take_up_step``)."""
        train_step, schedule_step = rj.take_up_step(self.core.step, int(self.state.step),
                                                    int(train_lib.schedule_step(self.state)))
        if train_step is not None:
            self.state = self.state.replace(step=jnp.asarray(train_step, jnp.int32))
        if schedule_step is not None:
            self.state = train_lib.set_schedule_step(self.state, schedule_step)

    def wait(self, fut: concurrent.futures.Future, timeout_s: float):
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

    def send_metadata(self, msg, recovering: bool = False) -> None:
        """Metadata with this learner's data position, which the syncer hands back if it comes back
        without its own snapshot part (``TakeUpPosition``)."""
        position = position_field(self.batches.position() if self.position_known else None, serde.MAX_STR_CHARS)
        loss = self.loss if math.isfinite(self.loss) else None  # a diverged step is the syncer's to see, not a crash
        self.net.send_metadata(dataclasses.replace(msg, data=position, recovering=recovering, loss=loss,
                                                   tokens=self.tokens, fingerprint=self.fingerprint))

    def drain(self, block_s: float = 0.0) -> None:
        """Merge what arrived; with ``block_s`` wait that long for the first item."""
        while True:
            try:
                item = self.net.next(block_s)
            except queue.Empty:
                break
            block_s = 0.0
            match item:
                case Arrived(arrived_s, update):
                    if self.sync is not None:  # its own upload of this fragment first (keep_local keeps θ_p there)
                        self.sync.flush(update.fragment)
                    self.handle(self.core.on_update(arrived_s, update))
                case Identity():  # a (re)connected update stream: is it still the syncer we follow?
                    self.handle(rj.on_identity(self.core, time.monotonic(), item.run_id, item.epoch,
                                                item.resumed_from, item.process))
                case Barrier():
                    self.barrier.on_status(item.started, item.need, item.joined, item.waiting_for)
                case Donate():
                    self.handle(self.donor.on_donate(time.monotonic(), item.recipient, item.versions))
                case SnapshotCut():  # its part of the snapshot is due
                    self.handle(self.core.on_snapshot_cut(time.monotonic(), item))
                case LinkSample():
                    self.replanner.on_link(item, self.core, self.payload_bytes, self.uploads)
                case ChannelsWidened():
                    emit({"event": "transport", "role": "learner", "learner": self.m, "region": self.region,
                          "step": self.core.step, **dataclasses.asdict(item)})
                case Donated(r, fut):
                    ls_io.on_state_sent(self, r, fut)
                case Saved(snap, fut):
                    ls_io.on_part_written(self, snap, fut)
                case Refused(reason):  # the syncer runs other settings: retrying cannot help
                    raise SyncerLost(reason)
                case StreamLost(reason):
                    raise SyncerLost(f"learner {self.m}: {reason}")
                case _:
                    typing.assert_never(item)
        if self.sync is not None:
            self.sync.check()
        silent = self.net.silent_s()
        limit_s = silent and self.cfg.transport.retry_budget_s + self.cfg.transport.call_timeout_s
        if silent is not None and silent[0] > limit_s:
            raise SyncerLost(f"no answer from the syncer for {silent[0]:.0f} s (transport.retry_budget_s + "
                             f"call_timeout_s = {limit_s:g} s); last error: {silent[1]}")
        if self.donor.asked:
            self.handle(self.donor.on_versions(time.monotonic(), self.core.version))
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
            self.handle(rj.on_fetched(self.core, time.monotonic(), got.run_id, got.epoch, got.resumed_from,
                                       got.fragment, got.values, got.version, got.global_step))

    # ---- the run --------------------------------------------------------------------

    # Methods kept in modules of their own (self is the Learner).
    _reach_syncer = learner_start.reach_syncer
    _await_start = learner_start.await_start
    _maybe_eval = learner_eval.maybe_eval
    evaluate = learner_eval.evaluate
    join = learner_join.join

    def train_step(self) -> float:
        """One inner step and what syncing asks around it: merge what arrived, wait where the protocol says,
        step, snapshot what is due. Returns when the step finished (``time.monotonic``)."""
        self.drain()
        while self.core.blocked and not self.stop.is_set():
            self.drain(block_s=0.05)
        t0 = time.monotonic()
        batch = self.batches.next()
        self.core.begin_step(t0)
        if self.ls is None:
            self.state, metrics = self.step_fn(self.state, batch.tokens)
        else:
            self.state, metrics = lk.step_together(self.ls, self.step_fn, self.state, batch.tokens, lk.OP_STEP)
        self.loss = float(metrics["loss"])  # also waits for the step to finish
        if self.cfg.run.min_step_s:
            time.sleep(max(0.0, self.cfg.run.min_step_s - (time.monotonic() - t0)))
        t1 = time.monotonic()
        self.compute_s += t1 - t0
        self.tokens += batch.n_tokens
        self.handle(self.core.step_done(t1, batch.n_tokens))
        self.replanner.after_step(self.core, self.payload_bytes, self.uploads)
        return t1

    def run(self) -> dict:
        self._reach_syncer()  # first: an unreachable syncer is said in seconds, not after a compile and a deadline
        # Compile before joining: the first step on a shared CPU can take longer than the liveness timeout.
        if self.ls is None:
            jax.block_until_ready(self.step_fn(self.state, self.batches.next().tokens))
        else:
            self.state, _ = lk.step_together(self.ls, self.step_fn, self.state, self.batches.next().tokens, lk.OP_COMPILE)
        self.on_compiled()
        self.net.start()
        try:
            return self._run()
        except Stopped:
            return {"event": "stopped", "role": "learner", "learner": self.m, "step": self.core.step}
        finally:
            self.writer.shutdown(wait=True)  # a part being written is finished, not torn
            if self.sync is not None:
                self.sync.close()
            self.net.stop()

    def _run(self) -> dict:
        joined = self.join(self.cfg.transport.call_timeout_s + self.cfg.transport.retry_budget_s)
        self.handle(self.resume.on_joined(time.monotonic(), self.core.run_id, joined.resumed_from, self.core.step,
                                           ls_io.parts_of(self)))
        self.position_known = True
        # Before the first metadata, which counts as this learner's join at the start barrier: a learner that
        # joined is ready to step at once (the eval's compile would otherwise hold it back behind its peers).
        initial_loss = self.evaluate()
        self.send_metadata(self.core.metadata())  # the hello: it carries this learner's settings
        hello_by = time.monotonic() + self.cfg.transport.call_timeout_s
        while not self.net.hello_answered.is_set() and time.monotonic() < hello_by and not self.stop.is_set():
            self.drain(block_s=0.05)  # refused settings stop the learner here, before its first step
        self.drain()
        self.net.start_probing()
        self._await_start()
        self.take_up_step()  # updates merged while it waited moved the global step on
        self.eval_seen_step = self.core.step  # eval points before it are not this learner's to take
        emit({"event": "start", "role": "learner", "learner": self.m, "region": self.region,
              "step": self.core.step, "schedule_step": int(train_lib.schedule_step(self.state)),
              "eval_loss": initial_loss, "bytes_sent": self.net.bytes_sent,
              "bytes_received": self.net.bytes_received})
        t_start, last_report, loss = time.monotonic(), 0.0, float("nan")
        while self.core.step < self.cfg.run.steps and not self.stop.is_set():
            t1 = self.train_step()
            loss = self.loss
            self._maybe_eval()
            if t1 - last_report >= self.cfg.run.report_every_s:
                last_report = t1
                emit({"event": "step", "role": "learner", "learner": self.m, "step": self.core.step,
                      "loss": loss, "tokens": self.tokens, "bytes_sent": self.net.bytes_sent,
                      "bytes_received": self.net.bytes_received, "versions": list(self.core.version),
                      "sync_stall_s": self.sync.stall_s if self.sync else 0.0})
        if self.stop.is_set():
            return {"event": "stopped", "role": "learner", "learner": self.m, "step": self.core.step}
        train_s = time.monotonic() - t_start
        emit({"event": "finishing", "role": "learner", "learner": self.m, "step": self.core.step,
              "train_s": train_s, "bytes_sent": self.net.bytes_sent, "bytes_received": self.net.bytes_received})
        # Before the final sync, whose merges come back with no steps trained in between.
        lag = self.core.merge_lag_steps / self.core.merge_lags if self.core.merge_lags else None
        report = final_sync(self)
        link = self.replanner.link
        return {"event": "final", "role": "learner", "learner": self.m, "region": self.region,
                "steps": self.core.step, "tokens": self.tokens, "train_s": train_s, "compute_s": self.compute_s,
                "initial_eval_loss": initial_loss, "last_loss": loss, "raw_bytes": self.raw_bytes,
                "payload_bytes": self.payload_bytes, "bytes_sent": self.net.bytes_sent,
                "bytes_received": self.net.bytes_received, "resyncs": self.resyncs,
                "link": link.to_event() if link is not None else None, "tau": self.core.cfg.tau,
                "merge_lag_steps": lag, "run_id": self.core.run_id, "epoch": self.core.epoch,
                "rejoins": self.rejoins, "snapshots_written": self.snapshots_written,
                "snapshot_stall_s": self.snapshot_stall_s, "stale_updates": self.core.stale_updates,
                "sync_stall_s": self.sync.stall_s if self.sync else 0.0,
                "recovery": self.resume.recovery,
                **report}
