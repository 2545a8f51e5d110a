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
broadcasts (:func:`from_leader`), in lockstep (``runtime.lockstep``: a header per
step, then the state the leader changed). See "Multi-host learners" in
docs/architecture.md.

Everything here but :func:`initialize` is cheap and deterministic; the pure
parts (config, row split, the join-timeout message) hold no JAX state.
"""
from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import threading
from typing import Any

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


__all__ = ["EXIT_JOB_BROKEN", "EXIT_PEERS_MISSING", "MultihostConfig", "from_leader", "global_batch", "global_mesh", "initialize", "is_leader", "join_timeout_message",
           "local_rows", "replicated", "to_host"]
