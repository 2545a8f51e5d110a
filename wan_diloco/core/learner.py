"""Sans-IO learner protocol (docs/method.md, "Learner loop"): counters, fragment sends, merges.

(Over 400 lines: one state machine whose methods all move the same counters and versions; the pieces
around it that need none of its internals live beside it: restore, peer, rejoin, final_sync.)

The driver owns the model and the clock. It calls ``begin_step``/``step_done``
around each inner step, answers ``Snapshot`` actions with the fragment's
current parameters, and applies ``ApplyGlobal`` actions to its parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.config import ConfigError, require
from wan_diloco.core.protocol import (
    ApplyGlobal,
    Codec,
    Ema,
    FragmentUpload,
    GlobalUpdate,
    IncarnationError,
    Metadata,
    ProtocolError,
    Rejoin,
    Resync,
    SaveState,
    SnapshotCut,
    SendFragment,
    SendMetadata,
    Snapshot,
    Tensors,
    encode_or_refuse,
    learner_node,
)
from wan_diloco.feedback import ErrorFeedback
from wan_diloco.fragments import Schedule, check_order, tau_bounds
from wan_diloco.outer import OuterConfig


@dataclass(frozen=True)
class LearnerConfig:
    sync_every: int = 8  # H
    num_fragments: int = 4  # P: one fragment due every H/P steps
    tau: int = 2  # overlap: steps a fragment may travel while the learner keeps training
    alpha: float = 0.0  # θ_p ← α·θ_local + (1−α)·Θ_global; 0 overwrites (Decoupled default)
    # θ_p ← Θ_global + (θ_local − θ_p at the snapshot): the steps taken while the fragment travelled
    # are kept (and counted into the next Δ) instead of being overwritten. Replaces the α rule.
    keep_local: bool = False
    # Beyond the paper (docs/method.md, "Eager updates"): at each send, θ_p ← Θ_base − lr·Δ_local (the outer
    # step this learner's own Δ would take, lr the run's outer lr) stands in for the global update while it
    # travels; on arrival θ_p ← Θ_new + (θ_local − the stand-in), the steps in between kept as keep_local keeps them.
    eager: bool = False
    blocking: bool = False  # wait for fragment p's update τ steps after sending it (synchronous baselines)
    error_feedback: bool = False
    # A networked learner that (re)joins with no state of its own takes a healthy peer's parameters,
    # inner optimizer and residuals (core.recovery) instead of starting a cold optimizer from Θ.
    peer_recovery: bool = True
    # Processes of one learner (runtime.multihost): one per host, P local ones under `launch`. Process 0
    # talks to the syncer; the others train in lockstep with it. 1: a single process.
    hosts: int = 1
    # Fragment sent in each of the P send slots of a round (slot k at step ⌊k·H/P⌋ mod H): a permutation
    # of 0..P-1, as `wan-diloco plan` prints it (plan.fragment_order). Empty: slot k sends fragment k.
    fragment_order: tuple[int, ...] = ()
    # Snapshots a networked learner finishes off its training thread at once (runtime.sync_worker: host
    # copy, Δ, error feedback, encode, framing); past it the training thread waits (`sync_stall_s`). 0: all
    # on the training thread between steps, as the simulator does (the same bits, slower).
    sync_in_flight: int = 2

    def validate(self) -> None:
        require(self.sync_every >= 1, "sync_every", f"must be >= 1, got {self.sync_every}")
        require(self.num_fragments >= 1, "num_fragments", f"must be >= 1, got {self.num_fragments}")
        require(self.tau >= 0, "tau", f"must be >= 0, got {self.tau}")
        require(isinstance(self.hosts, int) and not isinstance(self.hosts, bool) and self.hosts >= 1, "hosts",
                f"must be a whole number >= 1 (processes of one learner), got {self.hosts!r}")
        require(isinstance(self.sync_in_flight, int) and not isinstance(self.sync_in_flight, bool)
                and self.sync_in_flight >= 0, "sync_in_flight",
                f"must be a whole number >= 0 (0: encode on the training thread), got {self.sync_in_flight!r}")
        # τ >= H/P is allowed (several fragments in flight at once); τ >= H would overtake the next sync.
        lo, hi = tau_bounds(self.sync_every, self.num_fragments)
        require(lo <= self.tau <= hi, "tau", f"must be in [{lo}, {hi}] (below sync_every {self.sync_every}), "
                f"got {self.tau}")
        try:
            check_order(self.fragment_order, self.num_fragments)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        require(0.0 <= self.alpha <= 1.0, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(not (self.keep_local and self.alpha), "alpha",
                f"keep_local replaces the alpha rule: alpha must be 0 with it, got {self.alpha}")
        require(not (self.eager and self.alpha), "alpha",
                f"eager replaces the alpha rule: alpha must be 0 with it, got {self.alpha}")


@dataclass
class _InFlight:
    due_step: int
    sent_at_s: float
    sent_at_step: int
    c_steps: int = 0  # the fragment's counters when it was sent
    c_tokens: int = 0
    theta: Tensors | None = None  # θ_p as sent (keep_local), or the eager stand-in it was set to


@dataclass(frozen=True)
class PendingSnapshot:
    """A snapshot counted by ``begin_snapshot`` and not encoded yet (``encode_snapshot``)."""

    base: Tensors  # Θ_p at the snapshot: a merge meanwhile replaces the core's dict, never this one
    upload: FragmentUpload  # every field fixed at the snapshot, the payload aside
    sent: _InFlight


class LearnerCore:
    def __init__(
        self,
        cfg: LearnerConfig,
        learner: int,
        fragments: list[tuple[str, ...]],
        global_params: Tensors,
        codec: Codec,
        region: str = "",
        outer_lr: float = OuterConfig.lr,
    ):
        cfg.validate()
        require(len(fragments) == cfg.num_fragments, "num_fragments", f"config says {cfg.num_fragments}, got {len(fragments)} fragments")
        self.cfg, self.learner, self.region = cfg, learner, region
        self.outer_lr = np.float32(outer_lr)  # the eager stand-in's step (``LearnerConfig.eager``)
        self.node = learner_node(learner)
        self.fragments = fragments
        self.schedule = Schedule(cfg.sync_every, cfg.num_fragments, cfg.fragment_order)
        self.codec = codec
        P = cfg.num_fragments
        self.base = [{n: np.array(global_params[n], dtype=np.float32) for n in f} for f in fragments]
        self.version = [0] * P
        self.feedback = ErrorFeedback(enabled=cfg.error_feedback)
        self.step = 0
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.clock = VectorClock()
        self.in_flight: dict[int, _InFlight] = {}
        self.buffer: list[tuple[float, GlobalUpdate]] = []  # (arrival time, update)
        self.in_step = False
        self._step_began_s: float | None = None
        self.step_s = Ema()
        self.sync_s = Ema()
        self.merge_lags = 0  # merges of our own Δ, and the steps they came after the send, summed
        self.merge_lag_steps = 0
        # Identity of the syncer this learner follows (learnt at join, or from the first update).
        self.run_id = ""
        self.epoch = 0
        self.resumed_from = 0
        self.rejoining = 0  # the incarnation a Rejoin was asked for and not yet done
        self.syncer_processes: list[str] = []  # each syncer shard's process id, as its update stream said
        self.stale_updates = 0  # updates of an earlier incarnation, dropped
        self.snapshot_seen = 0  # the newest snapshot the syncer announced
        self.cut_due = 0  # a snapshot announced during a step: its part is written after the step
        self.snapshot_saved = 0  # the newest one whose part this learner wrote (reported in metadata)

    # ---- driver calls ---------------------------------------------------------------

    def begin_step(self, now_s: float) -> None:
        self.in_step = True
        self._step_began_s = now_s

    def step_done(self, now_s: float, n_tokens: int) -> list:
        """One inner step finished: count it, merge buffered updates, send what is due."""
        if not self.in_step:
            raise RuntimeError("step_done without begin_step")
        self.in_step = False
        if self._step_began_s is not None:
            self.step_s.add(now_s - self._step_began_s)
        self.step += 1
        for p in range(self.cfg.num_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += n_tokens
        actions = self._flush()
        for p in self.schedule.due(self.step):
            actions.append(Snapshot(p, self.step))
        self.clock = self.clock.tick(self.node)
        actions.append(SendMetadata(self.metadata()))
        return actions

    def abort_step(self) -> list:
        """The step in progress will not be counted (shutdown, failure): merge what it buffered."""
        self.in_step = False
        return self._flush()

    def finish(self) -> list:
        """End of the run: merge what is buffered, then snapshot every fragment for the final sync."""
        actions = self.abort_step()
        due = max(1, self.step)
        return actions + [Snapshot(p, due, final=True) for p in range(self.cfg.num_fragments)]

    def snapshot(self, now_s: float, fragment: int, due_step: int, theta: Tensors, final: bool = False) -> list:
        """θ_p after the due step -> the outer gradient Δ = Θ_base − θ_p, encoded for the wire: ``begin_snapshot``
        and ``encode_snapshot`` in one call, encoding first so that a refused Δ changes nothing."""
        base = self.base[fragment]
        enc = self._encode(fragment, base, theta)
        pending = self.begin_snapshot(now_s, fragment, due_step, final)
        send = SendFragment(self._upload(pending, theta, enc))
        if not self.cfg.eager or final:  # after the final sync nothing trains on: no stand-in
            return [send]
        # Eager: train on from this learner's own outer step Θ_p − lr·Δ_local until the global one arrives.
        pending.sent.theta = {n: base[n] - self.outer_lr * (base[n] - np.asarray(theta[n], dtype=np.float32))
                              for n in base}
        return [send, ApplyGlobal(fragment, pending.sent.theta, 0.0)]

    def begin_snapshot(self, now_s: float, fragment: int, due_step: int, final: bool = False) -> PendingSnapshot:
        """The protocol half of a snapshot, on the driver's thread: the fragment is in flight and the clock
        ticks now; ``encode_snapshot`` makes the upload later, on any thread, from θ_p as it was now."""
        sent = _InFlight(due_step, now_s, self.step, self.c_steps[fragment], self.c_tokens[fragment])
        self.in_flight[fragment] = sent
        self.clock = self.clock.tick(self.node)
        msg = FragmentUpload(
            learner=self.learner, fragment=fragment, due_step=due_step, base_version=self.version[fragment],
            c_steps=self.c_steps[fragment], c_tokens=self.c_tokens[fragment], clock=self.clock,
            delta={}, nbytes=0, region=self.region, final=final, epoch=self.epoch,
        )
        return PendingSnapshot(self.base[fragment], msg, sent)

    def encode_snapshot(self, pending: PendingSnapshot, theta: Tensors) -> FragmentUpload:
        """Δ, error feedback and encode of a begun snapshot. It reads and writes fragment p's residual, so
        a driver runs these in snapshot order and finishes them before anything else touches residuals
        (``join``, ``export``, ``adopt``, ``restore_feedback``, ``snapshot``)."""
        if self.cfg.eager and not pending.upload.final:
            raise ProtocolError("eager updates set their stand-in with the snapshot: use snapshot(), not a worker")
        enc = self._encode(pending.upload.fragment, pending.base, theta)
        return self._upload(pending, theta, enc)

    def _encode(self, fragment: int, base: Tensors, theta: Tensors):
        if set(theta) != set(base):
            raise ProtocolError(f"snapshot of fragment {fragment}: tensor names differ from the fragment's")
        what = f"fragment {fragment} of learner {self.learner}"
        fb = self.feedback
        fused = getattr(self.codec, "roundtrip_delta", None)
        if fused is None:  # a codec without the fused pass (tests' stand-ins): the same arithmetic, step by step
            local = {n: base[n] - np.asarray(theta[n], dtype=np.float32) for n in base}
            # Error feedback: what quantization dropped last time is sent with this Δ.
            delta = fb.compensate(fragment, local)
            enc = encode_or_refuse(self.codec, delta, what)
            fb.update(fragment, delta, enc.values)
            return enc
        try:
            enc, residual = fused(base, theta, fb.residual(fragment) if fb.enabled else None, fb.enabled)
        except ProtocolError:
            raise
        except ValueError as e:
            raise ProtocolError(f"{what}: {e}") from None
        if residual is not None:
            fb.keep(fragment, residual)
        return enc

    def _upload(self, pending: PendingSnapshot, theta: Tensors, enc) -> FragmentUpload:
        if self.cfg.keep_local:
            pending.sent.theta = {n: np.array(theta[n], dtype=np.float32) for n in pending.base}
        return replace(pending.upload, delta=enc.values, nbytes=enc.nbytes, payload=enc.payload)

    def on_update(self, now_s: float, update: GlobalUpdate) -> list:
        """A global fragment arrived; merged now if between steps, else after the current step."""
        if not 0 <= update.fragment < self.cfg.num_fragments:
            raise ProtocolError(f"global update for fragment {update.fragment}: only {self.cfg.num_fragments} fragments")
        which = self.identity(update.run_id, update.epoch, update.resumed_from)
        if which == "stale":
            self.stale_updates += 1
            return []
        if which == "new":
            if self.rejoining == update.epoch:
                return []
            self.rejoining = update.epoch
            return [Rejoin(update.epoch, update.resumed_from)]
        if self.in_step:
            self.buffer.append((now_s, update))
            return []
        return self._apply(now_s, update)

    def on_snapshot_cut(self, now_s: float, cut: SnapshotCut) -> list:
        """The syncer cut a snapshot: this learner's part of it is due (``SaveState``), now if between steps,
        else after the current step. Nothing for a cut it saw already (or a newer one), nor before it
        joined (it has no state of the run to keep), nor for one of an incarnation it no longer follows."""
        if cut.snapshot <= self.snapshot_seen or not self.epoch or cut.epoch < self.epoch:
            return []
        self.snapshot_seen = cut.snapshot
        if self.in_step:
            self.cut_due = cut.snapshot
            return []
        return [SaveState(cut.snapshot)]

    def identity(self, run_id: str, epoch: int, resumed_from: int) -> str:
        """How a message of (run, incarnation) relates to what this learner follows: "same", "stale" (an
        earlier incarnation) or "new" (the syncer resumed from a snapshot: rejoin). IncarnationError if
        following it would mix models: another run, or a syncer restarted without a snapshot."""
        if self.run_id and run_id and run_id != self.run_id:
            raise IncarnationError(self._other_run(run_id))
        if not self.epoch or not epoch or epoch == self.epoch:
            if epoch and not self.epoch:  # a learner that never joined (the simulator's) adopts the first
                self.epoch, self.run_id, self.resumed_from = epoch, run_id or self.run_id, resumed_from
            return "same"
        if epoch < self.epoch:
            return "stale"
        if not resumed_from:
            raise IncarnationError(
                f"the syncer restarted from scratch (incarnation {epoch}, resumed from no snapshot) while this "
                f"learner follows incarnation {self.epoch}: the run's global model is gone, and continuing would mix "
                f"two models. Restart the syncer with --resume (or the run with `wan-diloco launch --resume RUN_DIR`)")
        return "new"

    def meet(self, run_id: str, epoch: int, resumed_from: int, processes: str = "") -> str:
        """The syncer's identity at the start of an update stream (a connect or a reconnect): "same",
        "stale" or "new" as ``identity``. ``processes`` names the syncer process behind each shard
        (comma-separated, "" where not heard from yet). IncarnationError if following it would fork the
        run: an incarnation lower than one this learner followed (the syncer went back), or another
        process at the same incarnation, started from no snapshot, while this learner holds merged
        state of the run (a syncer restarted without --resume: a fresh model under the same run id)."""
        if self.run_id and run_id and run_id != self.run_id:
            raise IncarnationError(self._other_run(run_id))
        if self.epoch and epoch and epoch < self.epoch:
            raise IncarnationError(
                f"the syncer is at incarnation {epoch}, this learner already followed incarnation {self.epoch}: "
                f"it went back, and following it would mix two models. Restart the syncer with --resume (or the "
                f"run with `wan-diloco launch --resume RUN_DIR`)")
        ids = processes.split(",") if processes else []
        known = self.syncer_processes
        restarted = any(a and b and a != b for a, b in zip(known, ids))
        self.syncer_processes = [b or a for a, b in zip(known + [""] * len(ids), ids)] or known
        if restarted and epoch == self.epoch and not resumed_from and any(self.version):
            raise IncarnationError(
                f"the syncer restarted from scratch (a new process at incarnation {epoch}, resumed from no "
                f"snapshot) while this learner holds the run's merged state (fragment versions "
                f"{list(self.version)}): the run's global model is gone, and continuing would mix two models. "
                f"Restart the syncer with --resume (or the run with `wan-diloco launch --resume RUN_DIR`)")
        return self.identity(run_id, epoch, resumed_from)

    def _other_run(self, run_id: str) -> str:
        return (f"the syncer serves run {run_id!r}; this learner belongs to run {self.run_id!r}: following it would "
                f"mix two models (a syncer restarted without --resume starts a new run)")

    def join(self, run_id: str, epoch: int, resumed_from: int, fragments: list[tuple[Tensors, int]],
             global_step: int) -> list:
        """Take up the syncer's global state: at start, at a rejoin, and after the syncer resumed from a
        snapshot. ``fragments`` is (values, version) per fragment; what was in flight or buffered is
        dropped (it belongs to a model the syncer no longer has), the counters restart at zero."""
        if len(fragments) != self.cfg.num_fragments:
            raise ProtocolError(f"join: {len(fragments)} fragments, expected {self.cfg.num_fragments}")
        for p, (values, _) in enumerate(fragments):
            missing = set(self.fragments[p]) - set(values)
            if missing:
                raise ProtocolError(f"join: fragment {p} lacks tensors {sorted(missing)[:2]}")
        if self.run_id and run_id and run_id != self.run_id:
            raise IncarnationError(self._other_run(run_id))
        self.run_id, self.epoch, self.resumed_from, self.rejoining = run_id, epoch, resumed_from, 0
        self.snapshot_seen = max(self.snapshot_seen, resumed_from)  # its parts exist already
        self.base = [{n: np.array(v[n], dtype=np.float32) for n in self.fragments[p]} for p, (v, _) in enumerate(fragments)]
        self.version = [int(version) for _, version in fragments]
        self.in_flight.clear()
        self.buffer.clear()
        self.c_steps = [0] * self.cfg.num_fragments
        self.c_tokens = [0] * self.cfg.num_fragments
        self.feedback.reset()
        self.step = max(self.step, global_step)
        self.clock = self.clock.tick(self.node)
        return [ApplyGlobal(p, self.base[p], 0.0) for p in range(self.cfg.num_fragments)]

    def follow_run(self, run_id: str) -> None:
        """This learner belongs to run ``run_id`` (``run.run_id``): a syncer serving another is refused at the join."""
        self.run_id = run_id

    def advance(self, step: int) -> None:
        """Take up a step known from elsewhere (a snapshot part, a peer's state) if it is ahead."""
        self.step = max(self.step, step)

    def saved(self, snapshot: int) -> None:
        """The driver wrote this learner's part of ``snapshot`` durably; metadata reports it from now on."""
        self.snapshot_saved = max(self.snapshot_saved, snapshot)

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(tensors, info) of the protocol state a learner's snapshot part holds (the driver adds its
        train state and data position): bases, error-feedback residuals, versions, counters, clock."""
        tensors = {f"base/{p}/{n}": a for p, b in enumerate(self.base) for n, a in b.items()}
        tensors.update({f"feedback/{k}": v for k, v in self.feedback.state_dict().items()})
        info = {"learner": self.learner, "run_id": self.run_id, "epoch": self.epoch, "step": self.step,
                "versions": list(self.version), "c_steps": list(self.c_steps), "c_tokens": list(self.c_tokens),
                "clock": self.clock.to_dict()}
        return tensors, info

    def restore_feedback(self, tensors: Tensors) -> None:
        """Error-feedback residuals from a snapshot part (``export``); ValueError if they do not fit."""
        self.feedback.load_state_dict({k[len("feedback/"):]: v for k, v in tensors.items() if k.startswith("feedback/")})

    def resync(self, fragment: int, values: Tensors, version: int, global_step: int = 0) -> list:
        """Install the current global fragment after a version gap, on (re)join or after the final sync.

        A (re)joining learner also takes up the global schedule at ``global_step``."""
        missing = set(self.fragments[fragment]) - set(values)
        if missing:
            raise ProtocolError(f"resync of fragment {fragment}: missing tensors {sorted(missing)[:2]}")
        self.step = max(self.step, global_step)
        self.base[fragment] = {n: np.array(values[n], dtype=np.float32) for n in self.fragments[fragment]}
        self.version[fragment] = version
        self.in_flight.pop(fragment, None)
        self.c_steps[fragment] = self.c_tokens[fragment] = 0
        return [ApplyGlobal(fragment, self.base[fragment], 0.0)]

    def retune(self, tau: int) -> None:
        """Take a new τ while training (a plan from the measured link); refused values change nothing.

        Only when this learner waits changes: fragments in flight are held to
        the new τ from now on, the schedule and the protocol stay as they are."""
        cfg = replace(self.cfg, tau=tau)
        cfg.validate()
        self.cfg = cfg

    @property
    def blocked(self) -> bool:
        """True while a blocking learner must wait for a fragment sent τ or more steps ago."""
        if not self.cfg.blocking:
            return False
        return any(self.step - f.sent_at_step >= self.cfg.tau for f in self.in_flight.values())

    def metadata(self) -> Metadata:
        return Metadata(
            learner=self.learner, step=self.step, c_steps=tuple(self.c_steps), c_tokens=tuple(self.c_tokens),
            clock=self.clock, step_s=self.step_s.value, sync_s=self.sync_s.value, region=self.region,
            tau=self.cfg.tau, epoch=self.epoch, snapshot=self.snapshot_saved,
        )

    def adopt(self, tensors: Tensors, info: dict[str, Any]) -> None:
        """Recovery: take a healthy peer's protocol state (its ``export``; the driver copies its parameters
        and inner optimizer): its global view and versions, step, clock and error-feedback residuals.

        What this learner had in flight or buffered belongs to the old state and is dropped. The driver
        then replays, through ``on_update``, the updates that arrived while the state travelled (those
        the peer had already applied are ignored there). ProtocolError, nothing changed, if the state
        does not fit this run or this incarnation."""
        P = self.cfg.num_fragments
        versions = [int(v) for v in info.get("versions", ())]
        if len(versions) != P:
            raise ProtocolError(f"peer state: versions for {len(versions)} fragments, expected {P}")
        if self.run_id and info.get("run_id") and info["run_id"] != self.run_id:
            raise IncarnationError(self._other_run(str(info["run_id"])))
        if self.epoch and int(info.get("epoch", 0)) != self.epoch:
            raise ProtocolError(f"peer state of syncer incarnation {info.get('epoch')}, this learner follows {self.epoch}")
        base = []
        for p, names in enumerate(self.fragments):
            frag = {}
            for n in names:
                a = tensors.get(f"base/{p}/{n}")
                if a is None or np.shape(a) != self.base[p][n].shape:
                    raise ProtocolError(f"peer state: base/{p}/{n} missing or of the wrong shape")
                frag[n] = np.array(a, dtype=np.float32)
            base.append(frag)
        residuals = {k[len("feedback/"):]: v for k, v in tensors.items() if k.startswith("feedback/")}
        for key, a in residuals.items():
            head, _, name = key.partition("/")
            if not (head.isdigit() and int(head) < P and name in base[int(head)]
                    and np.shape(a) == base[int(head)][name].shape):
                raise ProtocolError(f"peer state: error-feedback residual {key!r} is not one of this run's tensors")
        try:
            clock = VectorClock.from_dict(info.get("clock", {}))
            self.feedback.load_state_dict(residuals)
        except ValueError as e:
            raise ProtocolError(f"peer state: {e}") from None
        self.base, self.version = base, versions
        self.step = max(self.step, int(info.get("step", 0)))
        self.clock = self.clock.merge(clock).tick(self.node)
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.in_flight.clear()
        self.buffer.clear()
        self.in_step = False

    # ---- internals ------------------------------------------------------------------

    def _flush(self) -> list:
        actions: list = []
        for arrived_s, update in self.buffer:
            actions += self._apply(arrived_s, update)
        self.buffer.clear()
        if self.cut_due:
            actions.append(SaveState(self.cut_due))
            self.cut_due = 0
        return actions

    def _apply(self, arrived_s: float, u: GlobalUpdate) -> list:
        p = u.fragment
        if u.to_version <= self.version[p]:
            return []  # already have it (duplicate after a reconnect)
        if u.from_version != self.version[p]:
            return [Resync(p, self.version[p], u.to_version)]
        base = self.base[p]
        if set(u.update) != set(base):
            raise ProtocolError(f"global update for fragment {p}: tensor names differ from the fragment's")
        for n in base:
            if u.update[n].shape != base[n].shape:
                raise ProtocolError(f"global update for {n!r}: shape {u.update[n].shape}, expected {base[n].shape}")
        self.base[p] = {n: base[n] + u.update[n] for n in base}
        self.version[p] = u.to_version
        sent = self.in_flight.pop(p, None)
        if sent is not None and self.learner in u.held_s:
            self.sync_s.add(max(0.0, arrived_s - sent.sent_at_s - u.held_s[self.learner]))
        if sent is not None:  # steps trained between sending this fragment and merging the answer
            self.merge_lags += 1
            self.merge_lag_steps += self.step - sent.sent_at_step
        # Adopt the global step: a slow learner jumps forward so fragments stay due together.
        self.step = max(self.step, u.global_step)
        if sent is not None and self.learner not in u.contributors and u.due_step >= sent.due_step:
            # Our Δ missed its round: we reach due steps later than the quorum by more than the grace.
            # The global step above was counted before the update left the syncer, and the quorum
            # has stepped since; adopting it alone leaves a learner one step behind in phase (as
            # after a rejoin with steady step times), so that every Δ it sends misses by the same
            # margin. One step more puts it back in phase; the token weights already count it fewer
            # steps.
            self.step = max(self.step, u.global_step + 1)
        self.clock = self.clock.receive(self.node, u.clock)
        if sent is not None and sent.theta is not None:
            # The steps since the snapshot stay in θ_p, so they stay on the counters of the next Δ.
            self.c_steps[p] -= sent.c_steps
            self.c_tokens[p] -= sent.c_tokens
            return [ApplyGlobal(p, {n: self.base[p][n] - sent.theta[n] for n in base}, 0.0, shift=True)]
        self.c_steps[p] = self.c_tokens[p] = 0
        return [ApplyGlobal(p, self.base[p], self.cfg.alpha)]
