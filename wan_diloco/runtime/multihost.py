"""One learner over several hosts: a JAX multi-controller job.

Every process of a learner runs the same program: :func:`initialize` joins the
job (``jax.distributed``; on CPU with gloo collectives, so that a P-process
learner runs on one machine and in the tests), :func:`global_mesh` spans every
process's devices on the data axis ``train`` already uses, and each process
feeds only its own rows of the global batch (:func:`local_rows`,
:func:`global_batch`). ``train.make_train_step`` and ``train.make_eval_fn``
then run unchanged on that mesh: XLA all-reduces the gradient across the
processes exactly as it does across the devices of one.

Process 0 (:func:`is_leader`) talks to the syncer; the others follow what it
broadcasts (:func:`from_leader`), in lockstep (:class:`Lockstep`: a header per
step, then the state the leader changed). See "Multi-host learners" in
docs/architecture.md.

Everything here but :func:`initialize` is cheap and deterministic; the pure
parts (config, row split, the join-timeout message) hold no JAX state.
"""
from __future__ import annotations

import dataclasses
import math
import os
import contextlib
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wan_diloco.config import ConfigError, require
from wan_diloco.train import DATA_AXIS
from wan_diloco.transport.security import split_host_port

# The exit status of a process whose peers did not all join in time; learner exits use 3 and 4.
EXIT_PEERS_MISSING = 5
# A process of a running job died or left: the collective the others were in failed.
EXIT_JOB_BROKEN = 6
# JAX's own join deadline is set this much later than ours, so that ours, which says what went wrong,
# always fires first: at JAX's, the C++ runtime aborts the process (SIGABRT and a stack trace).
JAX_DEADLINE_MARGIN_S = 10


@dataclasses.dataclass(frozen=True)
class MultihostConfig:
    """Where this process stands in its learner's job."""

    coordinator: str  # "host:port" of process 0's coordination service, the same for every process
    num_processes: int
    process_id: int  # 0 is the leader and hosts the coordination service
    local_device_ids: tuple[int, ...] | None = None  # accelerators this process uses (GPU ids); None: all it sees
    init_timeout_s: float = 300.0  # every process must have joined within this
    heartbeat_timeout_s: int = 100  # a process silent this long is taken for dead (JAX then aborts the others)

    def validate(self) -> None:
        require(isinstance(self.coordinator, str), "coordinator", f"expected host:port, got {self.coordinator!r}")
        try:
            _, port = split_host_port(self.coordinator)
        except ConfigError as e:
            raise ConfigError(f"coordinator: {e}") from None
        require(port > 0, "coordinator", f"expected host:port with a fixed port (the other processes "
                                          f"connect to it), got {self.coordinator!r}")
        require(_is_int(self.num_processes) and self.num_processes >= 1, "num_processes",
                f"must be an integer >= 1, got {self.num_processes!r}")
        require(_is_int(self.process_id) and 0 <= self.process_id < self.num_processes, "process_id",
                f"must be in 0..{self.num_processes - 1} (num_processes = {self.num_processes}), "
                f"got {self.process_id!r}")
        if self.local_device_ids is not None:
            ids = self.local_device_ids
            require(len(ids) > 0 and all(_is_int(i) and i >= 0 for i in ids), "local_device_ids",
                    f"must be a non-empty list of device ids >= 0 (or unset for all), got {list(ids)!r}")
            require(len(set(ids)) == len(ids), "local_device_ids", f"lists a device twice: {list(ids)!r}")
        require(isinstance(self.init_timeout_s, (int, float)) and math.isfinite(self.init_timeout_s)
                and self.init_timeout_s > 0, "init_timeout_s", f"must be a positive number of seconds, "
                                                                f"got {self.init_timeout_s!r}")
        require(_is_int(self.heartbeat_timeout_s) and self.heartbeat_timeout_s >= 1, "heartbeat_timeout_s",
                f"must be a whole number of seconds >= 1, got {self.heartbeat_timeout_s!r}")

    @property
    def leader(self) -> bool:
        return self.process_id == 0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- pure parts ----------------------------------------------------------------------------

def local_rows(batch: np.ndarray, process_id: int, num_processes: int) -> np.ndarray:
    """Process ``process_id``'s block of the global batch: rows ``[i*B/P, (i+1)*B/P)``.

    Every process draws the same global batch (same stream, same seed) and keeps its block, so the
    job trains on exactly the batch a one-process learner would, and every process's data position
    is the leader's."""
    rows = np.shape(batch)[0]
    require(rows % num_processes == 0, "batch_size",
            f"{rows} rows do not split evenly over the learner's {num_processes} processes")
    per = rows // num_processes
    return batch[process_id * per:(process_id + 1) * per]


def join_timeout_message(cfg: MultihostConfig, coordinator_listening: bool | None) -> str:
    """What a process says when the job did not form within ``cfg.init_timeout_s``."""
    me = f"learner process {cfg.process_id} of {cfg.num_processes}"
    if cfg.leader:
        others = "is process 1" if cfg.num_processes == 2 else f"are processes 1..{cfg.num_processes - 1}"
        why = (f"the coordinator is up at {cfg.coordinator}, but not all {cfg.num_processes} processes joined "
               f"within {cfg.init_timeout_s:g} s: {others} running, with num_processes = {cfg.num_processes} "
               f"and this coordinator address?")
    elif coordinator_listening is False:
        why = (f"nothing accepts connections at the coordinator {cfg.coordinator} (process 0) after "
               f"{cfg.init_timeout_s:g} s: is process 0 running, and is that address reachable from here?")
    else:
        why = (f"the coordinator {cfg.coordinator} (process 0) is reachable, but the job of "
               f"{cfg.num_processes} processes did not form within {cfg.init_timeout_s:g} s: is every "
               f"process running, each with its own process_id and num_processes = {cfg.num_processes}?")
    return f"{me}: {why} (multihost.init_timeout_s)"


# ---- joining the job -----------------------------------------------------------------------

def _cpu_may_run() -> bool:
    platforms = jax.config.jax_platforms or ""
    return not platforms or "cpu" in platforms.split(",")


def _listening(address: str) -> bool:
    host, port = split_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def initialize(cfg: MultihostConfig) -> None:
    """Join this process to its learner's job. Call before any other JAX work, once per process.

    Returns once all ``cfg.num_processes`` processes have joined. If they have not within
    ``cfg.init_timeout_s``, the process says why in one line on stderr and exits with
    :data:`EXIT_PEERS_MISSING`: a join blocked in JAX's C++ runtime cannot be interrupted with an
    exception, and JAX's own deadline would abort the process with a stack trace instead.
    """
    cfg.validate()
    if _cpu_may_run():
        # Without cross-process collectives a CPU job's all-reduce has nobody to talk to. The setting
        # is read only by the CPU client, so it costs nothing where the job runs on accelerators.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joined = threading.Event()

    def watchdog() -> None:
        if joined.wait(cfg.init_timeout_s):
            return
        listening = None if cfg.leader else _listening(cfg.coordinator)
        print(join_timeout_message(cfg, listening), file=sys.stderr, flush=True)
        os._exit(EXIT_PEERS_MISSING)

    threading.Thread(target=watchdog, name="multihost-join-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id,
            local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
            # The config says where everything is; a Slurm or cloud environment must not override it.
            cluster_detection_method="deactivate",
            initialization_timeout=math.ceil(cfg.init_timeout_s) + JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    finally:
        joined.set()


def is_leader() -> bool:
    """Whether this is process 0 of its job (always, in a single-process learner)."""
    return jax.process_index() == 0


# ---- the global mesh and its arrays ---------------------------------------------------------

def global_mesh() -> Mesh:
    """A 1-D mesh on ``train.DATA_AXIS`` over every process's devices, process by process.

    Ordering by process puts each process's devices in one contiguous block, so process i's rows
    (:func:`local_rows`) are rows ``[i*B/P, (i+1)*B/P)`` of the global batch."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (DATA_AXIS,))


def global_batch(local_tokens: Any, mesh: Mesh) -> jax.Array:
    """The global batch, sharded on the data axis, from this process's rows of it.

    Every process calls this with its own rows, the same number in each; the result is one array of
    ``rows x processes`` rows (no data crosses processes: each device gets its slice of the local rows)."""
    local = np.asarray(local_tokens)
    n_local = len(mesh.local_devices)
    require(n_local > 0, "mesh", "this process has no device in the mesh")
    require(local.ndim == 2, "batch", f"tokens must have shape (rows, seq_len + 1), got {local.shape}")
    require(local.shape[0] % n_local == 0, "batch_size",
            f"this process's {local.shape[0]} rows do not split evenly over its {n_local} devices")
    processes = mesh.devices.size // n_local
    global_shape = (local.shape[0] * processes, *local.shape[1:])
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(DATA_AXIS)), local, global_shape)


def to_host(tree: Any) -> Any:
    """numpy copies of a pytree's arrays, the whole array on every process.

    A replicated array (the params, the loss) is read from this process's own copy. One sharded over
    other processes is gathered, which is a collective: then every process must call this for the
    same arrays in the same order."""
    def one(x: Any) -> np.ndarray:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(one, tree)


def from_leader(tree: Any) -> Any:
    """The leader's values of a pytree of host arrays, on every process (numpy).

    A collective: every process calls it with arrays of the same shapes and dtypes (the followers'
    values are ignored), in the same order relative to every other collective of the job."""
    return multihost_utils.broadcast_one_to_all(tree, is_source=is_leader())


def replicated(host: Any, mesh: Mesh) -> jax.Array:
    """One host array as a global array replicated over ``mesh``, with no collective.

    Every process must pass the same value (what :func:`from_leader` returned). ``jax.device_put`` would
    check that with an all-gather per array; the lockstep already guarantees it."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P()), lambda index: host[index])


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


__all__ = ["EXIT_JOB_BROKEN", "EXIT_PEERS_MISSING", "JobBroken", "Lockstep", "MultihostConfig", "broken",
           "from_leader", "global_batch", "global_mesh", "initialize", "is_leader", "join_timeout_message",
           "local_rows", "replicated", "to_host"]
