"""A networked learner's evaluations: its held-out loss, and the run's eval curve (every
``run.eval_every_steps`` steps one learner in turn evaluates the global model Θ as it holds it).

Methods of ``runtime.learner.Learner`` kept in a module of their own (``self`` is the learner).
"""
from __future__ import annotations

import time

from wan_diloco import tree
from wan_diloco.runtime import lockstep as lk
from wan_diloco.runtime.events import emit


def eval_due(step: int, every: int, learners: int, learner: int) -> bool:
    """Every ``run.eval_every_steps`` steps one learner in turn evaluates (``learner`` = (step / every) mod learners)."""
    return bool(every) and step % every == 0 and (step // every) % learners == learner


def evaluate(self) -> float:
    """The held-out loss of this learner's parameters (with followers: a collective of every process)."""
    if self.ls is None:
        return self.evaluate_params(self.state.params)
    self.state, loss = lk.evaluate_together(self.ls, self.evaluate_params, self.state)
    return loss


def maybe_eval(self) -> None:
    """The run's eval curve (``eval`` events): the global model as this learner holds it (its global
    view Θ, not its local parameters) when ``eval_due`` says it is this learner's turn."""
    step = self.core.step
    if not eval_due(step, self.cfg.run.eval_every_steps, self.cfg.run.learners, self.m):
        return
    t0 = time.monotonic()
    flat = {n: v for fragment in self.core.base for n, v in fragment.items()}
    global_params = tree.unflatten(flat, self.state.params)
    if self.ls is None:
        loss = float(self.evaluate_params(global_params))
    else:
        self.state, loss = lk.evaluate_global_together(self.ls, self.evaluate_params, self.state, global_params)
    emit({"event": "eval", "role": "learner", "learner": self.m, "step": step, "eval_loss": loss,
          "versions": list(self.core.version), "tokens": self.tokens, "eval_s": round(time.monotonic() - t0, 3)})
