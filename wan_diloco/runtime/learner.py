"""A networked learner: jitted inner steps on this thread, the network on a ``NetThread``.

Between steps it merges what arrived (``LearnerCore.on_update``), and after a
step it copies the fragment due to host memory and hands the upload to the
network thread. It only waits on the network where the protocol says so
(``LearnerCore.blocked``), at (re)join (it fetches the current global
parameters from the syncer) and at the end (the final full sync).
"""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.assemble import Assembly, fragment_digest
from wan_diloco.config import ConfigError
from wan_diloco.planning import LinkEstimate, confirmed_move, replan_reasons, tau_for_link
from wan_diloco.core import ApplyGlobal, ProtocolError, Resync, SendFragment, SendMetadata, Snapshot, learner_node
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.netthread import NetThread
from wan_diloco.spec import RunSpec
from wan_diloco.transport import MessageError, TransportError


REPLAN_MIN_STEPS = 5  # steps timed before τ is planned from a link (τ counts steps)


class Learner:
    def __init__(self, cfg: RunSpec, learner: int, target: str, token: str, parts: Assembly | None = None):
        self.cfg, self.m = cfg, learner
        self.region = cfg.region(learner)
        parts = parts or Assembly(cfg)
        self.state = parts.state0
        self.layout = parts.layout
        self.codec = parts.codec
        self.core = parts.learner_core(learner)
        self.step_fn = parts.step_fn
        self.batches = parts.batches(learner)
        self.evaluate = lambda: parts.evaluate(self.state.params)
        self.net = NetThread(target, token, cfg.transport, learner_node(learner), self.region, self.codec,
                             parts.bulk_codec)
        self.stop = threading.Event()
        self.pending_resync: dict[int, concurrent.futures.Future] = {}
        self.tokens = 0
        self.compute_s = 0.0
        self.raw_bytes = 0  # fp32 size of what was uploaded: numerator of the compression ratio
        self.payload_bytes = 0
        self.resyncs = 0
        self.link = None  # the latest LinkSample
        self.planned_link: LinkEstimate | None = None  # the link the current τ was planned for
        self.unplanned: LinkEstimate | None = None  # a sample that came before the step time was known
        self.recent_links: collections.deque[LinkEstimate] = collections.deque(maxlen=cfg.plan.replan_confirm)
        self.uploads = 0

    # ---- actions --------------------------------------------------------------------

    def _handle(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, ApplyGlobal):
                flat = tree.flatten(self.state.params)
                flat.update({n: jnp.asarray(v) for n, v in a.mixed(flat).items()})
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
                self.net.send_metadata(a.msg)
            elif isinstance(a, Resync):
                if a.fragment not in self.pending_resync:
                    self.pending_resync[a.fragment] = self.net.fetch_fragment(f"fragment/{a.fragment}")

    def _install(self, p: int, version: int, global_step: int, values: dict) -> None:
        if version > self.core.version[p] or version == 0 == self.core.version[p]:
            self.resyncs += 1
            self._handle(self.core.resync(p, values, version, global_step))
        if self.core.step > int(self.state.step):  # a (re)joining learner took up the global schedule
            self.state = self.state.replace(step=jnp.asarray(self.core.step, jnp.int32))

    def _drain(self, block_s: float = 0.0) -> None:
        """Merge what arrived; with ``block_s`` wait that long for the first item."""
        while True:
            try:
                kind, item = self.net.inbox.get(timeout=block_s) if block_s else self.net.inbox.get_nowait()
            except queue.Empty:
                break
            block_s = 0.0
            if kind == "update":
                arrived_s, update = item
                self._handle(self.core.on_update(arrived_s, update))
            elif kind == "link":
                self._on_link(item)
            elif kind == "channels":
                emit({"event": "transport", "role": "learner", "learner": self.m, "region": self.region,
                      "step": self.core.step, **item})
            else:
                raise RuntimeError(f"learner {self.m}: {item}")
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
            self._install(*got)

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
        cap = min(plan.max_tau, self.cfg.learner.sync_every - 1)
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

    def join(self, timeout_s: float) -> None:
        """Fetch the current global parameters from the syncer: fresh start and rejoin alike."""
        futs = [self.net.fetch_fragment(f"fragment/{p}") for p in range(len(self.layout.fragments))]
        for fut in futs:
            self._install(*fut.result(timeout=timeout_s))

    def run(self) -> dict:
        # Compile before joining: the first step on a shared CPU can take longer than the liveness timeout.
        jax.block_until_ready(self.step_fn(self.state, self.batches.next().tokens))
        self.net.start()
        try:
            self.join(self.cfg.transport.call_timeout_s + self.cfg.transport.retry_budget_s)
            self.net.send_metadata(self.core.metadata())
            self.net.start_probing()
            initial_loss = self.evaluate()
            emit({"event": "start", "role": "learner", "learner": self.m, "region": self.region,
                  "step": self.core.step, "eval_loss": initial_loss, "bytes_sent": self.net.bytes_sent,
                  "bytes_received": self.net.bytes_received})
            t_start, last_report, loss = time.monotonic(), 0.0, float("nan")
            while self.core.step < self.cfg.run.steps and not self.stop.is_set():
                self._drain()
                while self.core.blocked and not self.stop.is_set():
                    self._drain(block_s=0.05)
                t0 = time.monotonic()
                batch = self.batches.next()
                self.core.begin_step(t0)
                self.state, metrics = self.step_fn(self.state, batch.tokens)
                loss = float(metrics["loss"])  # also waits for the step to finish
                if self.cfg.run.min_step_s:
                    time.sleep(max(0.0, self.cfg.run.min_step_s - (time.monotonic() - t0)))
                t1 = time.monotonic()
                self.compute_s += t1 - t0
                self.tokens += batch.n_tokens
                self._handle(self.core.step_done(t1, batch.n_tokens))
                if self.unplanned is not None and self.core.step >= REPLAN_MIN_STEPS:
                    self._replan(self.unplanned, fresh=False)
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
                    "merge_lag_steps": lag,
                    **report}
        finally:
            self.net.stop()

    def final_sync(self) -> dict:
        """Upload every fragment (flagged final); take the syncer's final fragments, by broadcast or bulk."""
        self._drain()
        self._handle(self.core.finish())
        budget_s = self.cfg.syncer.final_timeout_s + self.cfg.transport.retry_budget_s
        self.net.wait_uploads(budget_s)
        futs = [self.net.fetch_fragment(f"final/{p}") for p in range(len(self.layout.fragments))]
        finals = [self._final_fragment(p, fut, budget_s) for p, fut in enumerate(futs)]
        # The broadcast of the final merge normally arrives on the update stream; bulk is the fallback.
        deadline = time.monotonic() + 5.0
        while any(self.core.version[p] < v for p, v, _, _ in finals) and time.monotonic() < deadline:
            self._drain(block_s=0.05)
        by_bulk = 0
        for p, v, g, values in finals:
            if self.core.version[p] < v:
                by_bulk += 1
                self._handle(self.core.resync(p, values, v))
        flat = {n: np.asarray(a) for n, a in tree.flatten(self.state.params).items()}
        return {
            "versions": list(self.core.version), "final_by_bulk": by_bulk,
            "digests": [fragment_digest(self.core.base[p], names) for p, names in enumerate(self.layout.fragments)],
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


def run_learner(cfg: RunSpec, learner: int, target: str, token: str) -> int:
    """Process entry point: 0 after a completed final sync, 143 when stopped by a signal."""
    lrn = Learner(cfg, learner, target, token)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: lrn.stop.set())
    result = lrn.run()
    emit(result)
    return 0 if result["event"] == "final" else 143
