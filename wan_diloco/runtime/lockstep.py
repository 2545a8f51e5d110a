"""The processes of one multi-process learner in lockstep (docs/architecture.md, "Lockstep").

Every process of a JAX multi-controller job must run the same collectives in
the same order. The leader (process 0) decides what comes next from what the
network brought it, and tells the followers with one fixed-size header per
exchange (:class:`Lockstep`); a follower (:func:`run_follower`) does exactly
that and nothing else. A collective that fails means another process died:
:func:`broken` ends this one with one line and ``EXIT_JOB_BROKEN``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from wan_diloco.assemble import Assembly
from wan_diloco.config import require
from wan_diloco.runtime.multihost import EXIT_JOB_BROKEN, from_leader, global_batch, local_rows, replicated


class JobBroken(RuntimeError):
    """A collective of the learner's job failed: another of its processes died or left."""


# The ops of a lockstep header (its first int32).
OP_WAIT, OP_COMPILE, OP_STEP, OP_EVAL, OP_EVAL_PARAMS, OP_STOP = range(6)
_HEADER = 4  # op, arg (the exit status of OP_STOP), leaves changed, reserved; then the mask, then the batch


class Lockstep:
    """The processes of one learner in lockstep: the leader says what comes next, the followers do it.

    Every exchange is one header broadcast (an int32 vector of fixed size: the op, which state leaves
    the leader changed since the last exchange, and the step's global batch), then, if leaves changed,
    their values as one flat buffer per dtype. Both sides install those values as global replicated
    arrays, so after each exchange every process holds the same state, and then runs the op's jitted
    computation. The batch travels because the leader's data stream may move in ways the followers
    cannot see (a resumed position); it is small next to a step.

    The leader holds :attr:`lock` from its header to the end of the op's computation (``turn``), so
    that the heartbeat (``OP_WAIT`` while it waits on the network) never slips between the two."""

    def __init__(self, mesh: Mesh, state_like: Any, batch_shape: tuple[int, int], process_id: int,
                 num_processes: int, name: str = ""):
        """``name``: how this process signs its lines (default "learner process I of P")."""
        self.mesh, self.pid, self.n = mesh, process_id, num_processes
        self.name = name or f"learner process {process_id} of {num_processes}"
        leaves, self.treedef = jax.tree_util.tree_flatten(state_like)
        self.specs = [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves]
        self.param_specs = [(tuple(np.shape(x)), np.dtype(x.dtype))
                            for x in jax.tree_util.tree_leaves(state_like.params)]
        self.batch_shape = tuple(batch_shape)
        self.size = _HEADER + len(leaves) + int(np.prod(self.batch_shape))
        self.lock = threading.RLock()
        self.last_s = time.monotonic()  # the leader's latest exchange
        self._synced: list | None = None  # the leaves every process holds (the leader's view); None: none yet
        self._beat: threading.Thread | None = None
        self._beating = threading.Event()

    # ---- both sides ------------------------------------------------------------------------

    def feed(self, tokens: Any) -> jax.Array:
        """This process's rows of the global batch, as the global sharded array."""
        return global_batch(local_rows(np.asarray(tokens), self.pid, self.n), self.mesh)

    def _exchange(self, values: list | None, specs: list) -> list[np.ndarray]:
        """The leader's ``values`` (None on a follower) for leaves of these (shape, dtype), on every
        process: one broadcast of one flat buffer per dtype."""
        dtypes = sorted({d.str for _, d in specs})
        if values is None:
            flat = {d: np.zeros(sum(int(np.prod(s)) for s, dt in specs if dt.str == d), np.dtype(d)) for d in dtypes}
        else:
            wrong = [(np.shape(v), s) for v, (s, _) in zip(values, specs) if tuple(np.shape(v)) != s]
            if wrong:  # before the broadcast: buffers of other sizes than the followers expect would hang them
                raise ValueError(f"lockstep: a leaf of shape {wrong[0][0]} where the state has {wrong[0][1]}")
            flat = {d: np.concatenate([np.asarray(v, dt).reshape(-1) for v, (s, dt) in zip(values, specs)
                                       if dt.str == d] or [np.zeros(0, np.dtype(d))]) for d in dtypes}
        flat = _collective(lambda: from_leader(flat))
        out, at = [], dict.fromkeys(dtypes, 0)
        for shape, dt in specs:
            k = int(np.prod(shape))
            out.append(np.asarray(flat[dt.str][at[dt.str]:at[dt.str] + k]).reshape(shape))
            at[dt.str] += k
        return out

    def _install(self, state: Any, mask: np.ndarray, values: list | None) -> Any:
        leaves = jax.tree_util.tree_leaves(state)
        changed = [i for i in range(len(mask)) if mask[i]]
        if changed:
            got = self._exchange(values, [self.specs[i] for i in changed])
            for i, v in zip(changed, got):
                leaves[i] = replicated(v, self.mesh)
        state = jax.tree_util.tree_unflatten(self.treedef, leaves)
        self._synced = jax.tree_util.tree_leaves(state)
        return state

    def share_params(self, params: Any | None, like: Any) -> Any:
        """The leader's parameter tree ``params`` (host values; None on a follower) as global replicated
        arrays on every process (``OP_EVAL_PARAMS``: the global view Θ only the leader holds)."""
        values = None if params is None else jax.tree_util.tree_leaves(params)
        got = self._exchange(values, self.param_specs)
        treedef = jax.tree_util.tree_structure(like)
        return jax.tree_util.tree_unflatten(treedef, [replicated(v, self.mesh) for v in got])

    def stepped(self, state: Any) -> None:
        """The step every process ran produced this state: nothing of it needs to travel."""
        self._synced = jax.tree_util.tree_leaves(state)

    def handshake(self) -> None:
        """The job's first collective, right after it formed: it opens the connections between the
        processes (gloo opens them at first use: later, a dead peer is an error at once, where a connect
        to one would be retried for minutes) and checks that every process has the same state and batch
        layout as the leader (the same config); a ConfigError says so if not."""
        mine = np.array([0x10C5, self.size, len(self.specs), sum(int(np.prod(s)) for s, _ in self.specs)], np.int32)
        theirs = np.asarray(_collective(lambda: from_leader(mine)))
        require(np.array_equal(theirs, mine), "learner",
                f"{self.name}: the leader's state or batch differs from this process's (header {theirs[1]} vs "
                f"{mine[1]} int32, {theirs[2]} vs {mine[2]} leaves): do all processes read the same config?")
        self.last_s = time.monotonic()

    # ---- the leader ------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The leader's exchange and the computation that goes with it, as one unit."""
        with self.lock:
            try:
                yield
            except jax.errors.JaxRuntimeError as e:
                raise JobBroken(_first_line(e)) from None
            finally:
                self.last_s = time.monotonic()

    def lead(self, op: int, state: Any, tokens: Any = None, arg: int = 0) -> Any:
        """Send the header of ``op`` and the leaves of ``state`` changed since the last exchange (by
        identity: anything the leader replaced); returns the state as every process now holds it."""
        leaves = jax.tree_util.tree_leaves(state)
        synced = self._synced
        mask = np.array([synced is None or leaf is not synced[i] for i, leaf in enumerate(leaves)], np.int32)
        header = np.zeros(self.size, np.int32)
        header[:_HEADER - 1] = op, arg, int(mask.sum())
        header[_HEADER:_HEADER + len(mask)] = mask
        if tokens is not None:
            header[_HEADER + len(mask):] = np.asarray(tokens, np.int32).reshape(-1)
        _collective(lambda: from_leader(header))
        self.last_s = time.monotonic()
        return self._install(state, mask, [np.asarray(leaves[i]) for i in range(len(mask)) if mask[i]])

    def start_heartbeat(self, every_s: float) -> None:
        """While the leader waits on the network its followers wait in the next header: an ``OP_WAIT``
        header whenever ``every_s`` passed without an exchange tells them it lives (and the leader learns
        that a follower died). A failed one ends the process: nobody else would notice."""
        def beat() -> None:
            while not self._beating.wait(min(1.0, every_s / 2)):
                if time.monotonic() - self.last_s < every_s or not self.lock.acquire(blocking=False):
                    continue
                try:
                    header = np.zeros(self.size, np.int32)
                    header[0] = OP_WAIT
                    _collective(lambda: from_leader(header))
                    self.last_s = time.monotonic()
                except JobBroken as e:
                    broken(self.name, str(e))
                finally:
                    self.lock.release()

        self._beat = threading.Thread(target=beat, name="lockstep-heartbeat", daemon=True)
        self._beat.start()

    def stop(self, code: int) -> None:
        """Tell the followers to exit with ``code`` (the leader's own status); the last exchange."""
        self._beating.set()
        if self._beat is not None:
            self._beat.join()
        with self.lock:
            header = np.zeros(self.size, np.int32)
            header[:2] = OP_STOP, code
            _collective(lambda: from_leader(header))

    # ---- a follower ------------------------------------------------------------------------

    def follow(self, state: Any) -> tuple[int, int, Any, np.ndarray | None]:
        """Wait for the leader's next header; (op, arg, the state as the leader has it, the batch)."""
        header = _collective(lambda: from_leader(np.zeros(self.size, np.int32)))
        header = np.asarray(header)
        op, arg = int(header[0]), int(header[1])
        if op in (OP_WAIT, OP_STOP):
            return op, arg, state, None
        n = len(self.specs)
        state = self._install(state, header[_HEADER:_HEADER + n], None)
        return op, arg, state, header[_HEADER + n:].reshape(self.batch_shape)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _collective(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except JobBroken:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a collective leaves the job unusable
        raise JobBroken(_first_line(e)) from None


def broken(who: str, why: str) -> None:
    """End this process at once, with one line: its job is broken. ``os._exit``: a normal exit would
    wait in JAX's shutdown barrier for the process that is gone, then abort with a stack trace."""
    print(f"{who}: stopping: the learner's job broke, another of its processes died or left (a collective "
          f"failed: {why})", file=sys.stderr, flush=True)
    os._exit(EXIT_JOB_BROKEN)




def step_together(ls: Lockstep, step_fn: Callable, state: Any, tokens: Any, op: int) -> tuple[Any, Any]:
    """The leader's side of one step of every process: the header (with the batch and what the leader
    changed in ``state``), then the step on each process's rows; (the state to go on with, metrics).
    ``OP_COMPILE`` keeps the old state (the step before the join)."""
    with ls.turn():
        state = ls.lead(op, state, tokens)
        new, metrics = jax.block_until_ready(step_fn(state, ls.feed(tokens)))
        if op == OP_COMPILE:
            return state, metrics
        ls.stepped(new)
        return new, metrics


def evaluate_together(ls: Lockstep, evaluate_params: Callable, state: Any) -> tuple[Any, float]:
    """The leader's side of the held-out loss of the parameters every process holds (an evaluation is a
    collective): (the state as shared, the loss)."""
    with ls.turn():
        state = ls.lead(OP_EVAL, state)
        return state, float(evaluate_params(state.params))


def evaluate_global_together(ls: Lockstep, evaluate_params: Callable, state: Any, global_params: Any) -> tuple[Any, float]:
    """The leader's side of evaluating its global view Θ: Θ is the leader's alone, so it travels to the
    followers, then every process evaluates. (the state as shared, the loss)."""
    with ls.turn():
        state = ls.lead(OP_EVAL_PARAMS, state)
        params = ls.share_params(global_params, state.params)
        return state, float(evaluate_params(params))


def run_follower(parts: Assembly, lockstep: Lockstep) -> int:
    """Process entry point of a follower (process 1.. of a multi-process learner): no network, no protocol
    state; it does what each header of the leader says, with the same jitted computations in the same
    order, and exits with the status the leader says. Signals are ignored: the leader decides when the
    job stops (it stops cleanly on its own signal and tells the followers)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    print(f"{lockstep.name}: following the leader (process 0)", file=sys.stderr, flush=True)
    state = parts.state0
    try:
        while True:
            op, arg, state, tokens = lockstep.follow(state)
            if op == OP_STOP:
                return arg
            if op in (OP_STEP, OP_COMPILE):
                new, _ = jax.block_until_ready(parts.step_fn(state, lockstep.feed(tokens)))
                if op == OP_STEP:
                    state = new
                    lockstep.stepped(state)
            elif op == OP_EVAL:
                float(parts.evaluate(state.params))
            elif op == OP_EVAL_PARAMS:
                float(parts.evaluate(lockstep.share_params(None, state.params)))
            elif op != OP_WAIT:
                broken(lockstep.name, f"the leader sent op {op}, which this version does not know")
    except (JobBroken, jax.errors.JaxRuntimeError) as e:
        broken(lockstep.name, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    raise AssertionError("not reached")
