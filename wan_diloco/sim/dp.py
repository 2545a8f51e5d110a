"""The data-parallel baseline on the simulator's virtual clock.

Synchronous SPMD across regions: one model, global batch M × learner batch,
every step waits for the slowest learner and a ring all-reduce over the WAN
(2(M−1)/M of the gradient bytes per learner, 2(M−1) latency hops), and the
whole job stalls while any learner is down (no elasticity).
"""
from __future__ import annotations

import time

import numpy as np

from wan_diloco import model as model_lib
from wan_diloco import tree
from wan_diloco.assemble import Assembly
from wan_diloco.core.evals import due_point
from wan_diloco.tape import Outage
from wan_diloco.sim.common import Progress, SimResult, step_time
from wan_diloco.spec import RunSpec, to_document


def _down_until(outages: list[Outage], t: float) -> float | None:
    """If some learner is down at t, the time the last overlapping outage ends."""
    ends = [o.up_at for o in outages if o.down_at <= t < o.up_at]
    return max(ends) if ends else None


def run_dp(spec: RunSpec, parts: Assembly, outages: list[Outage], progress: Progress | None) -> SimResult:
    t0 = time.perf_counter()
    cfg, M = spec.simulate, spec.run.learners
    its = [parts.batches(m) for m in range(M)]
    rngs = [np.random.default_rng([spec.run.seed, m]) for m in range(M)]
    speeds = cfg.speeds or (1.0,) * M
    grad_bytes = model_lib.param_count(parts.state0.params) * 4
    ring = 2 * (M - 1) / M
    comm_s = (ring * grad_bytes * 8 / (cfg.bandwidth_gbit_s * 1e9) + (M - 1) * cfg.rtt_s) if M > 1 else 0.0
    state, now, tokens, useful, busy, bytes_sent = parts.state0, 0.0, 0, 0.0, 0.0, 0
    budget_steps = spec.train.total_steps
    curve = [{"step": 0, "tokens": 0, "time_s": 0.0, "eval_loss": parts.evaluate(state.params)}]
    step = 0
    while step < budget_steps:
        resume = _down_until(outages, now)
        if resume is not None:
            now = resume  # stalled: nobody trains until every learner is back
            continue
        dts = [step_time(cfg, speeds[m], rngs[m]) for m in range(M)]
        step_s = max(dts) + comm_s
        failure = [o.down_at for o in outages if now < o.down_at < now + step_s]
        if failure:
            now = min(failure)  # the step dies with the learner; redone after the stall
            continue
        batches = [it.next() for it in its]
        state, _ = parts.step_fn(state, np.concatenate([b.tokens for b in batches]))
        tokens += sum(b.n_tokens for b in batches)
        useful += sum(dts)
        busy += step_s
        bytes_sent += int(ring * grad_bytes) * M
        now += step_s
        step += 1
        if due_point(step - 1, step, cfg.curve_every_steps) is not None or step == budget_steps:
            curve.append({"step": step, "tokens": tokens, "time_s": now, "eval_loss": parts.evaluate(state.params)})
        if progress:  # every step: the bar moves with the steps, the loss with the eval points
            progress(step / budget_steps, {**curve[-1], "eval_step": curve[-1]["step"], "step": step})
    return SimResult(
        config=to_document(spec), initial_eval_loss=curve[0]["eval_loss"], final_eval_loss=curve[-1]["eval_loss"],
        tokens=tokens, goodput=useful / (M * now), uptime=busy / now, fragment_syncs=[step],
        bytes_sent=bytes_sent, global_steps=step, virtual_time_s=now, wall_s=time.perf_counter() - t0,
        curve=curve, params_count=model_lib.param_count(parts.state0.params),
        params={n: np.asarray(a, dtype=np.float32) for n, a in tree.flatten(state.params).items()},
    )
