"""A networked learner's evaluations: its held-out loss, and the run's eval curve (every
``run.eval_every_steps`` steps one learner in turn evaluates the global model Θ as it holds it; when is
``core.evals``' rule, as in the simulator).

Methods of ``runtime.learner.Learner`` kept in a module of their own (``self`` is the learner).
"""
from __future__ import annotations

import time

from wan_diloco import tree
from wan_diloco.core.evals import eval_point
from wan_diloco.runtime import lockstep as lk
from wan_diloco.runtime.events import emit


def evaluate(self) -> float:
    """The held-out loss of this learner's parameters (with followers: a collective of every process)."""
    if self.ls is None:
        return self.evaluate_params(self.state.params)
    self.state, loss = lk.evaluate_together(self.ls, self.evaluate_params, self.state)
    return loss


def maybe_eval(self) -> None:
    """The run's eval curve (``eval`` events): the global model as this learner holds it (its global
    view Θ, not its local parameters) when ``eval_point`` says this learner owes one."""
    step, last = self.core.step, self.eval_seen_step
    self.eval_seen_step = step
    due = eval_point(last, step, self.cfg.run.eval_every_steps, self.cfg.run.learners, self.m)
    if due is None:
        return
    t0 = time.monotonic()
    flat = {n: v for fragment in self.core.base for n, v in fragment.items()}
    global_params = tree.unflatten(flat, self.state.params)
    if self.ls is None:
        loss = float(self.evaluate_params(global_params))
    else:
        self.state, loss = lk.evaluate_global_together(self.ls, self.evaluate_params, self.state, global_params)
    # The point is the multiple it stands for; a jump may have carried this learner a few steps past it.
    emit({"event": "eval", "role": "learner", "learner": self.m, "step": due, "taken_at_step": step,
          "eval_loss": loss, "versions": list(self.core.version), "tokens": self.tokens,
          "eval_s": round(time.monotonic() - t0, 3)})
