"""Everything both drivers build from a run spec, built once: params, layout, codec, step/eval, batches.

The simulated and the network driver take their learners and syncer from
here, so a simulated run trains the same model on the same data with the same
fragments and codec as a real one.
"""
from __future__ import annotations

import dataclasses
import hashlib
from functools import cached_property
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from wan_diloco import data as data_lib
from wan_diloco import model as model_lib
from wan_diloco import shards as shards_lib
from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.checkpoint import CheckpointError, read_init_params, tensor_specs
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.compression.frame import FORMAT_VERSION as CODEC_FORMAT_VERSION
from wan_diloco.config import ConfigError, require
from wan_diloco.core import LearnerCore, SyncerCore
from wan_diloco.core import fingerprint as fingerprint_lib
from wan_diloco.core.messages import PROTOCOL_VERSION
from wan_diloco.fragments import Layout, Schedule, make_fragments
from wan_diloco.spec import RunSpec


def host_flat(params) -> dict[str, np.ndarray]:
    """Flat name -> float32 numpy copy of a parameter tree."""
    return {n: np.asarray(a, dtype=np.float32) for n, a in tree.flatten(params).items()}


def fragment_digest(values: Mapping[str, np.ndarray], names: tuple[str, ...]) -> str:
    """SHA-256 of a fragment's float32 bytes in name order: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(np.ascontiguousarray(values[n], dtype="<f4").tobytes())
    return h.hexdigest()


def fragments_of(spec: RunSpec, sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The run's fragments of a model with these tensor sizes; ConfigError if some would be empty."""
    def split(p: int):
        return make_fragments(spec.run.fragmenter, sizes, p, model_lib.layer_index)

    P = spec.learner.num_fragments
    frags = split(P)
    empty = [p for p, f in enumerate(frags) if not f]
    if empty:
        fits = next((p for p in range(P - 1, 0, -1) if all(split(p))), 1)
        raise ConfigError(
            f"learner.num_fragments: {P} leaves fragments {empty[:8]}{'...' if len(empty) > 8 else ''} empty with "
            f"the {spec.run.fragmenter!r} fragmenter on this model ({len(sizes)} tensors); at most {fits} fit")
    return frags


def preflight(spec: RunSpec, data: bool = True, learner: int | None = None) -> None:
    """What would stop every process at start, checked before any starts (no compile, nothing on a device):
    the fragments fit the model, ``model.init`` (if set) holds the model's parameters, and (``data``: on
    a host that trains) the corpus is there: that ``learner``'s, or every learner's (``launch``: all on
    this host)."""
    like = model_lib.abstract_params(spec.model)
    fragments_of(spec, {n: int(np.prod(a.shape)) for n, a in tree.flatten(like).items()})
    if spec.model.init:
        init_params(spec, like)
    if not data:
        return
    learners = range(spec.run.learners) if learner is None else [learner]
    for corpus in dict.fromkeys(spec.data_of(m).corpus for m in learners):
        where = next((f"data.regions.{r}" for r, c in spec.data.regions if c == corpus), "data.corpus")
        try:
            data_lib.check_corpus(dataclasses.replace(spec.data, corpus=corpus))
        except ConfigError as e:
            field, _, why = str(e).partition(": ")
            raise ConfigError(f"{where if field == 'corpus' else 'data.' + field}: {why}") from None


def init_params(spec: RunSpec, like=None) -> dict[str, np.ndarray]:
    """``model.init``'s tensors by name, checked against the model (``like``: its abstract parameters):
    the same names, shapes and dtypes, finite values; else one ConfigError naming ``model.init``."""
    like = model_lib.abstract_params(spec.model) if like is None else like
    try:
        return read_init_params(spec.model.init, tensor_specs(like))
    except CheckpointError as e:
        raise ConfigError(f"model.init: {e}") from None


class Assembly:
    """The parts of one run. Cheap to make: each part is built on first use and kept."""

    def __init__(self, spec: RunSpec, learner: int | None = None, mesh: Mesh | None = None):
        """``learner``: the parts as that learner's process has them (its region's corpus, ``[data.regions]``);
        None: one corpus for every learner (``data.corpus``, as the simulator reads it). ``mesh``: the
        devices the step and eval run on, if not this process's (``run.devices``): a multi-process
        learner's global mesh (``runtime.multihost.global_mesh``)."""
        self.spec, self.learner = spec, learner
        if mesh is not None:
            self.mesh = mesh  # takes the place of the cached property below

    # ---- model and fragments ----------------------------------------------------------

    @cached_property
    def params0(self):
        """The shared starting point Θ(0), the same in every process: ``model.init``'s parameters, or
        fresh ones from ``run.seed``."""
        if not self.spec.model.init:
            return model_lib.init_params(self.spec.model, jax.random.PRNGKey(self.spec.run.seed))
        like = model_lib.abstract_params(self.spec.model)
        return tree.unflatten({n: jax.numpy.asarray(a) for n, a in init_params(self.spec, like).items()}, like)

    @cached_property
    def state0(self) -> train_lib.TrainState:
        """Θ(0) with a fresh inner optimizer (learners only: the syncer never builds one)."""
        s = self.spec
        return train_lib.init_state(s.model, s.train, jax.random.PRNGKey(s.run.seed), params=self.params0)

    @cached_property
    def flat0(self) -> dict[str, np.ndarray]:
        return host_flat(self.params0)

    @cached_property
    def layout(self) -> Layout:
        frags = fragments_of(self.spec, {n: int(a.size) for n, a in self.flat0.items()})
        return Layout(frags, {n: a.shape for n, a in self.flat0.items()})

    @cached_property
    def codec(self) -> FragmentCodec:
        """Outer gradients and updates on the wire, as ``[codec]`` says."""
        return FragmentCodec(self.spec.codec, self.layout)

    @cached_property
    def bulk_codec(self) -> FragmentCodec:
        """Whole global fragments (rejoin, resync, final fetch): lossless fp32 whatever ``[codec]`` says."""
        return FragmentCodec(CodecConfig(bits=32, zstd=False), self.layout)

    def learner_core(self, m: int) -> LearnerCore:
        return LearnerCore(self.spec.learner, m, self.layout.fragments, self.flat0, self.codec,
                           region=self.spec.region(m), outer_lr=self.spec.syncer.outer.lr)

    @cached_property
    def shard_plan(self) -> list[int]:
        """The syncer shard of each fragment (``shards.owners``, balanced by bytes)."""
        return shards_lib.owners(self.layout.nbytes, self.spec.syncer.shards)

    @cached_property
    def fingerprint(self) -> str:
        """What a learner and the syncer must agree on (``core.fingerprint``): the learner sends it with
        its metadata, the syncer refuses a learner whose fingerprint differs from its own."""
        spec, lay, c = self.spec, self.layout, self.spec.codec
        layout = fingerprint_lib.digest(repr([(n, lay.shapes[n], "float32") for f in lay.fragments for n in f]
                                             + [len(f) for f in lay.fragments]))
        # The offset rule (fragments.Schedule): slot k at k*H//P sends fragment order[k]; the order is named
        # only when it is not the identity, so a run that sets none keeps its fingerprint.
        sched = Schedule(spec.learner.sync_every, spec.learner.num_fragments, spec.learner.fragment_order)
        order = {} if sched.order == tuple(range(sched.num_fragments)) else {
            "fragment_order": "-".join(map(str, sched.order))}
        # Eager learners step their fragments on their own between merges: named only when on, as the order.
        eager = {"eager": True, "syncer.outer.lr": spec.syncer.outer.lr} if spec.learner.eager else {}
        return fingerprint_lib.encode({
            "protocol": {"version": PROTOCOL_VERSION},
            "layout": {"run.fragmenter": spec.run.fragmenter, "fragments": layout},
            "learner": {"sync_every": spec.learner.sync_every, "num_fragments": spec.learner.num_fragments,
                        "offset": "p*H//P", **order, **eager, "tau": spec.learner.tau, "plan.adapt_tau": spec.plan.adapt_tau,
                        "plan.max_tau": spec.plan.max_tau},
            "codec": {"format": CODEC_FORMAT_VERSION, "bits": c.bits, "block_size": c.block_size,
                      "scale_dtype": c.scale_dtype, "int4_codebook": c.int4_codebook, "zstd": c.zstd},
            # One shard owns everything: only with more is there a plan to disagree on.
            "syncer": {"shards": spec.syncer.shards, **({"plan": fingerprint_lib.digest(repr(self.shard_plan))}
                                                        if spec.syncer.shards > 1 else {})},
            # Θ(0) from a file: a learner that read another file (or none) would train from another start.
            **({"model": {"init": self.init_digest}} if spec.model.init else {}),
            # Direct stripes: a learner uploading to a port its syncer does not serve would only retry.
            **({"transport": {"direct_port": spec.transport.direct_port}} if spec.transport.direct_port else {}),
            "run": {"run_id": spec.run.run_id, "learners": spec.run.learners},
        })

    @cached_property
    def init_digest(self) -> str:
        """Θ(0)'s digest (``fragment_digest`` of every tensor, shortened), as the fingerprint carries it."""
        return "#" + fragment_digest(self.flat0, tuple(sorted(self.flat0)))[:12]

    def syncer_core(self, bounded: bool = False, shard: int | None = None) -> SyncerCore:
        """``bounded``: refuse learner steps past the run's budget (a networked run, where learners stop
        there; the simulator's live learners may take more steps when others drop out). ``shard``:
        the core of that syncer shard, owning its fragments only; None: every fragment."""
        cfg = self.spec.syncer
        if bounded:
            # A learner may adopt the global step + 1 after a late merge: one sync period of slack.
            cfg = dataclasses.replace(cfg, max_step=self.spec.run.steps + self.spec.learner.sync_every,
                                      max_tokens_per_step=self.spec.run.batch_size * self.spec.model.seq_len,
                                      final_min_step=self.spec.run.steps)
        owned = None if shard is None else shards_lib.owned(self.shard_plan, shard)
        return SyncerCore(cfg, self.layout.fragments, self.flat0, model_lib.is_embedding, self.codec, owned)

    # ---- training -----------------------------------------------------------------------

    @cached_property
    def mesh(self):
        """This process's devices (``run.devices``, indices into ``jax.local_devices()``; all when empty)."""
        ids = self.spec.run.devices
        if not ids:
            return train_lib.local_mesh()
        devices = jax.local_devices()
        require(max(ids) < len(devices), "run.devices",
                f"{list(ids)}, but this process has {len(devices)} devices: {', '.join(map(str, devices))}")
        return train_lib.local_mesh([devices[i] for i in ids])

    @cached_property
    def step_fn(self):
        return train_lib.make_train_step(self.spec.model, self.spec.train, self.mesh)

    @cached_property
    def data(self) -> data_lib.DataConfig:
        return self.spec.data if self.learner is None else self.spec.data_of(self.learner)

    @cached_property
    def peers(self) -> list[int]:
        """The learners that split this corpus: all of them, or those of regions that read this path."""
        return list(range(self.spec.run.learners)) if self.learner is None else self.spec.data_peers(self.learner)

    @cached_property
    def corpus(self) -> data_lib.Corpus:
        return data_lib.load_corpus(self.data)

    @cached_property
    def data_shards(self) -> list[np.ndarray]:
        """Each peer's part of the training tokens (``data.shard``); not the syncer's shards (``shard_plan``)."""
        n, block = len(self.peers), self.data.shard_block_tokens
        return [data_lib.shard(self.corpus.train, i, n, block).tokens for i in range(n)]

    def batches(self, m: int) -> data_lib.FailoverBatches:
        """Learner m's batches: its own shard, and down learners' shards when told who is down."""
        r = self.spec.run
        return data_lib.FailoverBatches(self.data_shards, self.peers.index(m), r.batch_size, self.spec.model.seq_len,
                                        seed=r.seed * 1009 + m)

    @cached_property
    def tokens_per_step(self) -> int:
        """Tokens of one step of every learner together."""
        r = self.spec.run
        return r.batch_size * self.spec.model.seq_len * r.learners

    @cached_property
    def evaluate(self):
        """params -> mean loss on the held-out eval set (the same windows in every process)."""
        r = self.spec.run
        ev = data_lib.eval_batches(self.corpus.eval, r.eval_batch_size, self.spec.model.seq_len, r.eval_batches)
        if self.mesh.is_multi_process:
            # Every process holds the same windows: placed once here, each with no collective (placing a
            # host batch on another process's devices checks its equality with an all-gather per call).
            n = self.mesh.devices.size
            require(r.eval_batch_size % n == 0, "run.eval_batch_size",
                    f"{r.eval_batch_size} does not split over the learner's {n} devices (all its processes)")
            sharding = NamedSharding(self.mesh, PartitionSpec(train_lib.DATA_AXIS))
            ev = [jax.make_array_from_callback(b.shape, sharding, lambda index, b=b: b[index]) for b in ev]
        fn = train_lib.make_eval_fn(self.spec.model, self.mesh)
        return lambda params: fn(params, ev)
