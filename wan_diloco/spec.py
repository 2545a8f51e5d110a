# Over ~400 lines: the run file in one place (its own tables, the cross-table rules, the renamed keys, the
# short names and the embedded default), so every key and default is declared once and found here.
"""One run, one TOML file: read by ``simulate``, ``launch``, ``syncer``, ``learner`` and the benchmarks.

Tables (every key optional; each default is stated once, in the dataclass named):

- ``[run]`` :class:`RunConfig`: M, step budget, batch, seed, eval set, addresses
- ``[regions]`` ``regions.RegionsConfig``: region names, where learners and the syncer live, the links
- ``[model]`` ``model.ModelConfig``: a ``preset`` plus optional explicit dimensions; ``init``: start weights
- ``[data]`` ``data.DataConfig``: corpus, bytes read, eval split, shard blocks
- ``[learner]`` ``core.LearnerConfig``: H, P, τ, α, error feedback
- ``[syncer]`` ``core.SyncerConfig`` (and ``[syncer.outer]``): K, grace, merge, outer optimizer
- ``[train]`` ``train.TrainConfig``: inner AdamW and its schedule
- ``[transport]`` ``transport.TransportConfig`` (and ``[transport.tls]``)
- ``[codec]`` ``compression.CodecConfig``: bits of outer gradients and updates on the wire
- ``[plan]`` :class:`PlanConfig`: CU target and margin of plans; per-learner τ from measured links
- ``[checkpoint]`` ``checkpoint.CheckpointConfig``: where snapshots and the final parameters go, how often
- ``[simulate]`` :class:`SimulateConfig`: only the simulator's time and link model and baseline;
  real runs ignore it, so one file goes from ``simulate`` to ``launch`` and back.

Values that must agree between tables are derived, and refused when set
otherwise: ``syncer.num_learners`` is ``run.learners``, ``syncer.tau`` is
``learner.tau``, ``syncer.sync_every`` is ``learner.sync_every``, ``data.vocab_size`` is ``model.vocab_size``,
``train.total_steps`` is the step budget. The bearer token comes from the
``WAN_DILOCO_TOKEN`` environment variable, else ``run.token`` (the variable wins, as for the TLS files).
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

import tomli_w

from wan_diloco import model as model_lib
from wan_diloco.checkpoint import CheckpointConfig, CheckpointError, params_file
from wan_diloco.compression.config import CodecConfig
from wan_diloco.config import ConfigError, did_you_mean, from_mapping, load_toml, require
from wan_diloco.core import LearnerConfig, SyncerConfig
from wan_diloco.data import DataConfig
from wan_diloco.fragments import STRATEGIES
from wan_diloco.model import ModelConfig
from wan_diloco.regions.topology import RegionsConfig, regions_from_mapping
from wan_diloco.train import TrainConfig
from wan_diloco.transport.config import TransportConfig
from wan_diloco.transport.security import check_token

TOKEN_ENV = "WAN_DILOCO_TOKEN"
BASELINES = ("dp", "diloco", "streaming", "decoupled")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the processes of one run share besides the protocol settings."""

    learners: int = 4  # M
    steps: int = 300  # global step budget
    batch_size: int = 16  # sequences per learner step
    seed: int = 0
    eval_batches: int = 8
    # The eval set (eval_batches x eval_batch_size windows of held-out text) does not shrink with the batch.
    eval_batch_size: int = 16
    fragmenter: Literal["layer", "tensor", "balanced"] = "balanced"
    host: str = "127.0.0.1"  # syncer bind address
    port: int = 0  # syncer gRPC port; 0 picks a free one (the launcher tells the learners)
    status_port: int = 0  # syncer /status and /metrics; 0 picks a free one, -1 disables
    token: str = ""  # bearer token; $WAN_DILOCO_TOKEN wins over it (a secret is better kept out of the file)
    tick_s: float = 1.0  # liveness check period of the syncer
    report_every_s: float = 0.5  # progress lines on stdout at most this often
    # Networked runs: the global model's held-out loss every this many steps (0: at start and end only).
    # The learners take turns (the one with id (step / eval_every_steps) mod M), so one that is down costs points.
    # (The simulator's curve has its own cadence, simulate.curve_every_steps: there an eval costs no one time.)
    eval_every_steps: int = 0
    min_step_s: float = 0.0  # learners pace their steps to at least this long (emulates slower chips)
    run_dir: str = "runs"  # launcher: where metrics.jsonl and logs go
    # launcher: experiment trackers fed the run's scalars beside metrics.jsonl, each its own extra
    # (runtime.trackers). The older `tensorboard = true` still reads as "tensorboard" here.
    trackers: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = ()
    # The learners' JAX platform under `launch`: "cpu" (they share this host's cores), "gpu" (NVIDIA, the [cuda]
    # extra), "auto" (JAX picks). The syncer always runs on the CPU.
    platform: Literal["cpu", "gpu", "auto"] = "cpu"
    # launch, platform "gpu": learner m sees GPUs m*N .. m*N+N-1 only (CUDA_VISIBLE_DEVICES); 0: all of them.
    devices_per_learner: int = 0
    # A learner's devices: indices into its jax.local_devices() (`learner --devices 0,1`); empty: all of them.
    devices: tuple[int, ...] = ()
    # The run's identity in every message; empty: the syncer makes one at a fresh start (a resume keeps
    # the snapshot's). A learner given one refuses a syncer serving another.
    run_id: str = ""
    # The start barrier (core.barrier): no learner takes a training step before this many learners have
    # joined the syncer. 0: every learner of the run under `launch` (it writes the number into the run's
    # config), 1 for a standalone syncer.
    min_learners_to_start: int = 0
    start_timeout_s: float = 600.0  # a barrier not met by then fails the run, naming who never joined

    def validate(self) -> None:
        require(self.learners >= 1, "learners", f"must be >= 1, got {self.learners}")
        require(isinstance(self.min_learners_to_start, int) and 0 <= self.min_learners_to_start <= self.learners,
                "min_learners_to_start", f"must be in 0..run.learners ({self.learners}; 0: the default), "
                f"got {self.min_learners_to_start!r}")
        require(math.isfinite(self.start_timeout_s) and self.start_timeout_s > 0, "start_timeout_s",
                f"must be a finite number of seconds > 0, got {self.start_timeout_s}")
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.eval_batches >= 1, "eval_batches", f"must be >= 1, got {self.eval_batches}")
        require(self.eval_batch_size >= 1, "eval_batch_size", f"must be >= 1, got {self.eval_batch_size}")
        require(self.fragmenter in STRATEGIES, "fragmenter", f"must be one of {', '.join(STRATEGIES)}")
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(-1 <= self.status_port < 65536, "status_port", "must be -1 (off) or a port, 0 for any")
        require(self.min_step_s >= 0, "min_step_s", f"must be >= 0, got {self.min_step_s}")
        require(self.tick_s > 0, "tick_s", f"must be > 0, got {self.tick_s}")
        require(self.report_every_s > 0, "report_every_s", f"must be > 0, got {self.report_every_s}")
        require(self.eval_every_steps >= 0, "eval_every_steps", f"must be >= 0 (0: off), got {self.eval_every_steps}")
        require(self.devices_per_learner >= 0, "devices_per_learner", f"must be >= 0, got {self.devices_per_learner}")
        require(len(set(self.devices)) == len(self.devices) and all(isinstance(i, int) and i >= 0 for i in self.devices),
                "devices", f"must be distinct device indices >= 0, got {list(self.devices)}")
        require(len(set(self.trackers)) == len(self.trackers), "trackers",
                f"names a tracker twice: {list(self.trackers)}")
        require(len(self.run_id) <= 64 and all(c.isascii() and (c.isalnum() or c in "._-") for c in self.run_id),
                "run_id", f"must be at most 64 of A-Z a-z 0-9 . _ -, got {self.run_id[:70]!r}")


@dataclasses.dataclass(frozen=True)
class SimulateConfig:
    """The simulator's own model of time and links, and the baseline it runs (``wan-diloco simulate``).

    Times are virtual seconds; ``speeds`` are step-time factors (1.2 = 20 % slower).
    """

    baseline: Literal["dp", "diloco", "streaming", "decoupled"] = "decoupled"
    tokens: int = 0  # if > 0, a token budget (all learners together) replaces run.steps
    step_time_s: float = 0.5
    step_noise: float = 0.0  # sigma of the lognormal step-time noise
    speeds: tuple[float, ...] = ()
    bandwidth_gbit_s: float = 0.1  # per learner link, each direction
    rtt_s: float = 0.06
    curve_every_steps: int = 50  # global steps between points of the simulated eval curve
    # Live learners also read the shards of learners that are down, so no shard drops out of the mix
    # while its learner is away (data.FailoverBatches). Off: a down learner's data waits for it.
    data_failover: bool = True
    # Each merge takes its time on its syncer shard at plan.shard_merge_gb_s (the one merge rate of a run),
    # queued behind the shard's earlier merges. Off: merges take no virtual time.
    merge_takes_time: bool = False

    def validate(self) -> None:
        require(self.baseline in BASELINES, "baseline", f"must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        require(self.tokens >= 0, "tokens", f"must be >= 0, got {self.tokens}")
        require(self.step_time_s > 0, "step_time_s", "must be > 0")
        require(self.step_noise >= 0, "step_noise", "must be >= 0")
        require(all(s > 0 for s in self.speeds), "speeds", "factors must be > 0")
        require(self.bandwidth_gbit_s > 0, "bandwidth_gbit_s", "must be > 0")
        require(self.rtt_s >= 0, "rtt_s", "must be >= 0")
        require(self.curve_every_steps >= 1, "curve_every_steps", f"must be >= 1, got {self.curve_every_steps}")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """How a run is planned from its links (``wan-diloco plan``, and the learners while they train).

    With ``adapt_tau`` each learner takes the smallest τ its measured link
    allows (``planning.tau_for_link``, from its probe and its measured step
    time, at most ``max_tau`` and within ``fragments.tau_bounds``: below H) and plans again when
    ``replan_confirm`` probes in a row find the link's rate moved the same way
    by more than ``replan_threshold``.
    """

    target_cu: float = 0.95
    margin: float = 0.1  # share of each link's rate a plan leaves unused
    adapt_tau: bool = False
    replan_threshold: float = 0.2
    replan_confirm: int = 2  # probes in a row that must show a move (one noisy probe does not re-plan)
    max_tau: int = 5
    # What one syncer shard merges, GB/s of fp32-equivalent outer gradients (bench/syncer.py measures it on
    # the syncer's host: docs/benchmarks.md); `plan` warns when the run needs more syncer.shards than it has,
    # and the simulator charges each merge at this rate with simulate.merge_takes_time. Unset: this checkout's
    # bench/results/syncer.json, else planning.shards.DEFAULT_SHARD_MERGE_GB_S (shard_merge_rate).
    shard_merge_gb_s: float | None = None

    def validate(self) -> None:
        require(0 < self.target_cu < 1, "target_cu", f"must be in (0, 1), got {self.target_cu}")
        require(self.shard_merge_gb_s is None or (
            math.isfinite(self.shard_merge_gb_s) and self.shard_merge_gb_s > 0), "shard_merge_gb_s",
                f"must be a finite number > 0 (GB/s), got {self.shard_merge_gb_s}")
        require(0 <= self.margin < 1, "margin", f"must be in [0, 1), got {self.margin}")
        require(0 < self.replan_threshold < 10, "replan_threshold", f"must be in (0, 10), got {self.replan_threshold}")
        require(self.max_tau >= 1, "max_tau", f"must be >= 1, got {self.max_tau}")
        require(1 <= self.replan_confirm <= 10, "replan_confirm", f"must be in [1, 10], got {self.replan_confirm}")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The whole run: every table of the file, validated and cross-checked. Build it with
    :meth:`RunSpec.load` or :meth:`RunSpec.from_dict` (``from_dict({})`` is every default)."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    learner: LearnerConfig
    syncer: SyncerConfig
    train: TrainConfig
    transport: TransportConfig
    codec: CodecConfig
    simulate: SimulateConfig
    regions: RegionsConfig
    plan: PlanConfig
    checkpoint: CheckpointConfig
    preset: str  # the [model] preset the dimensions started from (for reports)

    @classmethod
    def load(cls, path: str | Path | None) -> "RunSpec":
        """The spec in the TOML file ``path`` (:func:`load`); None gives the embedded default
        (``examples/local.toml``). A bad file is one ConfigError naming the key."""
        return load(path)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "RunSpec":
        """The spec of a TOML-shaped dict (``{"run": {"learners": 2}, "model": {"preset": "micro"}}``; tables
        and keys as in the file, every one optional), validated like a file (:func:`from_document`)."""
        return from_document(doc)

    def region(self, learner: int) -> str:
        """The region learner ``learner`` runs in."""
        return self.regions.region_of(learner)

    def data_of(self, learner: int) -> DataConfig:
        """What learner ``learner`` reads: ``data`` with its region's corpus (``[data.regions]``)."""
        return dataclasses.replace(self.data, corpus=self.data.corpus_of(self.region(learner)))

    def data_peers(self, learner: int) -> list[int]:
        """The learners that read the same corpus as ``learner`` (its own included): they split it."""
        mine = self.data_of(learner).corpus
        return [m for m in range(self.run.learners) if self.data_of(m).corpus == mine]

    def token(self) -> str:
        """The bearer token (see :meth:`given_token`); a missing one is a ConfigError."""
        token = self.given_token()
        require(bool(token), TOKEN_ENV, "not set and no run.token in the run file: the run needs a bearer token")
        return token

    def given_token(self) -> str:
        """``$WAN_DILOCO_TOKEN``, else ``run.token``, else "" (the launcher makes one up); one too short
        to be a token is a ConfigError naming where it came from (the variable or the key). The environment
        wins over the run file, as for the TLS files (``host_tls``): one run file is copied to every host,
        and each host gives its own secret. An empty variable is an unset one."""
        env = os.environ.get(TOKEN_ENV, "")
        return check_token(env, TOKEN_ENV) if env else self.run.token and check_token(self.run.token, "run.token")

    def with_changes(self, **tables: Mapping[str, Any]) -> "RunSpec":
        """A new spec with some keys of some tables replaced (``with_changes(run={"learners": 8})``),
        validated and cross-checked like a file."""
        doc = to_document(self)
        for name, changes in tables.items():
            require(name in TABLES, name, f"unknown table; known tables are {', '.join(TABLES)}")
            doc[name] = {**doc.get(name, {}), **changes}
        return from_document(doc)


TABLES = ("run", "model", "data", "learner", "syncer", "train", "transport", "codec", "simulate", "regions", "plan",
          "checkpoint")


def _table(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name, {})
    require(isinstance(value, Mapping), name, f"must be a table, got {type(value).__name__}")
    return dict(value)


def _derived(table: dict[str, Any], key: str, value: Any, where: str, source: str) -> None:
    """``table[key]`` is ``value``, taken from ``source``; a different explicit value is an error."""
    if key in table and table[key] != value:
        raise ConfigError(f"{where}.{key}: {table[key]!r} differs from {source} = {value!r}; "
                          f"leave it out (it is derived) or change {source}")
    table[key] = value


def _model(table: Mapping[str, Any]) -> tuple[str, ModelConfig]:
    table = dict(table)
    name = table.pop("preset", "tiny")
    require(isinstance(name, str), "model.preset", f"must be a string, got {name!r}")
    base = model_lib.preset(name)
    where, sep, attr = str(table.get("module", "")).rpartition(":")
    if where.endswith(".py"):  # children and resumes run from elsewhere: the run's config names the file absolutely
        table["module"] = f"{Path(where).resolve()}{sep}{attr}"
    if isinstance(table.get("init"), str) and table["init"]:  # the file, absolute: children run from elsewhere
        try:
            table["init"] = str(params_file(table["init"]))
        except CheckpointError as e:
            raise ConfigError(f"model.init: {e}") from None
    return name, from_mapping(ModelConfig, {**dataclasses.asdict(base), **table}, prefix="model.")


# Keys that were renamed: (table, old key) -> what to write instead. A file with an old key is refused
# with this, rather than with a bare "unknown field".
RENAMED: dict[tuple[str, str], str] = {
    ("run", "eval_every"): "run.eval_every_steps",
    ("simulate", "eval_every"): "simulate.curve_every_steps",
    ("simulate", "shard_merge_gb_s"): "plan.shard_merge_gb_s (the one merge rate) with simulate.merge_takes_time = true",
}


def _check_renamed(doc: Mapping[str, Any]) -> None:
    for (table, key), new in RENAMED.items():
        if isinstance(doc.get(table), Mapping) and key in doc[table]:
            raise ConfigError(f"{table}.{key}: renamed; write {new} instead")


def _run_table(doc: Mapping[str, Any]) -> dict[str, Any]:
    """[run], with the older ``tensorboard = true`` read as "tensorboard" in ``trackers``."""
    table = _table(doc, "run")
    if "tensorboard" in table:
        old = table.pop("tensorboard")
        require(isinstance(old, bool), "run.tensorboard", f"must be true or false, got {old!r}")
        trackers = table.get("trackers", [])
        if old and isinstance(trackers, (list, tuple)) and "tensorboard" not in trackers:
            table["trackers"] = [*trackers, "tensorboard"]
    return table


def from_document(doc: Mapping[str, Any]) -> RunSpec:
    """Build and cross-check the whole spec from a parsed TOML document."""
    unknown = sorted(set(doc) - set(TABLES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown table; known tables are {', '.join(TABLES)}"
                          + did_you_mean(unknown[0], TABLES))
    _check_renamed(doc)
    run = from_mapping(RunConfig, _run_table(doc), prefix="run.")
    preset, model = _model(_table(doc, "model"))
    data_t = _table(doc, "data")
    _derived(data_t, "vocab_size", model.vocab_size, "data", "model.vocab_size")
    if isinstance(data_t.get("regions"), Mapping):  # [data.regions]: region = "path"
        data_t["regions"] = [[k, v] for k, v in data_t["regions"].items()]
    data = from_mapping(DataConfig, data_t, prefix="data.")
    learner = from_mapping(LearnerConfig, _table(doc, "learner"), prefix="learner.")
    if learner.hosts > 1:  # each process of a learner feeds its own block of every batch's rows
        require(run.batch_size % learner.hosts == 0, "run.batch_size",
                f"{run.batch_size} does not split over the learner's {learner.hosts} processes (learner.hosts)")
        require(not run.devices, "run.devices",
                f"not with learner.hosts = {learner.hosts}: each process uses every device it sees (limit them "
                f"with CUDA_VISIBLE_DEVICES, or run.devices_per_learner under launch)")
        require(run.devices_per_learner % learner.hosts == 0, "run.devices_per_learner",
                f"{run.devices_per_learner} GPUs do not split over the learner's {learner.hosts} processes "
                f"(learner.hosts)")
    syncer_t = _table(doc, "syncer")
    _derived(syncer_t, "num_learners", run.learners, "syncer", "run.learners")
    _derived(syncer_t, "tau", learner.tau, "syncer", "learner.tau")
    _derived(syncer_t, "sync_every", learner.sync_every, "syncer", "learner.sync_every")
    syncer = from_mapping(SyncerConfig, syncer_t, prefix="syncer.")
    require(syncer.shards <= learner.num_fragments, "syncer.shards",
            f"must be at most learner.num_fragments ({learner.num_fragments}): a shard owns whole fragments, "
            f"got {syncer.shards}")
    simulate = from_mapping(SimulateConfig, _table(doc, "simulate"), prefix="simulate.")
    require(not simulate.speeds or len(simulate.speeds) == run.learners, "simulate.speeds",
            f"needs one factor per learner (run.learners = {run.learners}), got {len(simulate.speeds)}")
    train_t = _table(doc, "train")
    train_t.setdefault("warmup_steps", TrainConfig.warmup_steps)
    _derived(train_t, "total_steps", inner_steps(run, model, simulate), "train", "the step budget")
    # Warmup is at most a tenth of the run, so a short run is not all warmup.
    if isinstance(train_t["warmup_steps"], int):  # a wrong type is reported by from_mapping below
        train_t["warmup_steps"] = min(train_t["warmup_steps"], train_t["total_steps"] // 10)
    train = from_mapping(TrainConfig, train_t, prefix="train.")
    transport = from_mapping(TransportConfig, _table(doc, "transport"), prefix="transport.")
    codec = from_mapping(CodecConfig, _table(doc, "codec"), prefix="codec.")
    require(not codec.stochastic_rounding, "codec.stochastic_rounding",
            "not available in runs yet (the learners and the syncer encode without a PRNG key)")
    regions = regions_from_mapping(_table(doc, "regions"))
    for name, _ in data.regions:
        require(name in regions.names, f"data.regions.{name}", f"no such region; [regions] names {list(regions.names)}")
    require(not regions.learners or len(regions.learners) == run.learners, "regions.learners",
            f"names the region of {len(regions.learners)} learners, run.learners = {run.learners}")
    plan = from_mapping(PlanConfig, _table(doc, "plan"), prefix="plan.")
    checkpoint = from_mapping(CheckpointConfig, _table(doc, "checkpoint"), prefix="checkpoint.")
    return RunSpec(run, model, data, learner, syncer, train, transport, codec, simulate, regions, plan, checkpoint,
                   preset)


def inner_steps(run: RunConfig, model: ModelConfig, simulate: SimulateConfig) -> int:
    """Steps of the lr schedule: run.steps, or the simulator's token budget in steps of all learners."""
    if simulate.tokens:
        return max(2, -(-simulate.tokens // (run.batch_size * model.seq_len * run.learners)))
    return run.steps


def to_document(spec: RunSpec) -> dict[str, Any]:
    """The spec as a TOML-shaped document (derived keys left out), so that from_document gives it back."""
    doc: dict[str, Any] = {}
    for name in TABLES:
        table = dataclasses.asdict(getattr(spec, name))
        doc[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in table.items()}
    doc["model"]["preset"] = spec.preset
    doc["data"]["regions"] = dict(spec.data.regions)
    for table, key in (("data", "vocab_size"), ("syncer", "num_learners"), ("syncer", "tau"), ("syncer", "sync_every"),
                       ("train", "total_steps")):
        doc[table].pop(key)
    doc["transport"] = {k: v for k, v in doc["transport"].items() if v is not None}
    if doc["transport"].get("tls") is None:
        doc["transport"].pop("tls", None)
    return doc


def _without_none(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_none(v) for k, v in node.items() if v is not None}
    return node


def dumps(spec: RunSpec) -> str:
    """The spec as TOML text (``None`` means "unset" and is left out), read back by :func:`from_document`."""
    return tomli_w.dumps(_without_none(to_document(spec)))


# Short names for the keys studies vary most (simulate's flags, benchmarks, tests): name -> (table, key).
SHORT_NAMES: dict[str, tuple[str, str]] = {
    "preset": ("model", "preset"), "learners": ("run", "learners"), "steps": ("run", "steps"),
    "batch_size": ("run", "batch_size"), "seed": ("run", "seed"), "eval_batches": ("run", "eval_batches"),
    "eval_batch_size": ("run", "eval_batch_size"), "fragmenter": ("run", "fragmenter"),
    "corpus": ("data", "corpus"), "shard_block_tokens": ("data", "shard_block_tokens"), "holdout": ("data", "holdout"),
    "fragments": ("learner", "num_fragments"), "sync_every": ("learner", "sync_every"), "tau": ("learner", "tau"),
    "alpha": ("learner", "alpha"), "keep_local": ("learner", "keep_local"),
    "error_feedback": ("learner", "error_feedback"), "quorum": ("syncer", "quorum"), "grace": ("syncer", "grace"),
    "merge": ("syncer", "merge"), "outer_lr": ("syncer.outer", "lr"), "outer_momentum": ("syncer.outer", "momentum"),
    "staleness": ("syncer.outer", "staleness"), "staleness_power": ("syncer.outer", "staleness_power"),
    "eager": ("learner", "eager"),
    "inner_lr": ("train", "lr"), "warmup_steps": ("train", "warmup_steps"), "bits": ("codec", "bits"),
    "baseline": ("simulate", "baseline"), "tokens": ("simulate", "tokens"), "step_time_s": ("simulate", "step_time_s"),
    "step_noise": ("simulate", "step_noise"), "speeds": ("simulate", "speeds"),
    "bandwidth_gbit_s": ("simulate", "bandwidth_gbit_s"), "rtt_s": ("simulate", "rtt_s"),
    "eval_every": ("simulate", "curve_every_steps"), "data_failover": ("simulate", "data_failover"),
    "shards": ("syncer", "shards"), "shard_merge_gb_s": ("plan", "shard_merge_gb_s"),
    "merge_takes_time": ("simulate", "merge_takes_time"), "fragment_order": ("learner", "fragment_order"),
}


def set_short(doc: dict[str, Any], **values: Any) -> dict[str, Any]:
    """Set keys of a TOML-shaped ``doc`` in place by their :data:`SHORT_NAMES`; returns it."""
    for name, value in values.items():
        require(name in SHORT_NAMES, name,
                f"unknown setting; known: {', '.join(sorted(SHORT_NAMES))}{did_you_mean(name, SHORT_NAMES)}")
        table, key = SHORT_NAMES[name]
        node = doc
        for part in table.split("."):
            node = node.setdefault(part, {})
            require(isinstance(node, dict), table, "must be a table")
        node[key] = list(value) if isinstance(value, tuple) else value
    return doc


def from_short(**values: Any) -> RunSpec:
    """A spec from defaults and :data:`SHORT_NAMES` values: ``from_short(learners=8, bits=4)``."""
    return from_document(set_short({}, **values))


def load(path: str | Path | None) -> RunSpec:
    """The spec in ``path``; None gives the embedded default (``examples/local.toml``)."""
    if path is None:
        return from_document(tomllib.loads(DEFAULT_TOML))
    return from_document(load_toml(path))


# The embedded default of `wan-diloco train`, also written out as examples/local.toml.
# Sized so 4 JAX learners sharing 2 CPU cores show a falling loss within about a minute.
DEFAULT_TOML = """\
# wan-diloco: syncer + 4 learners in 2 regions on loopback (the default of `wan-diloco train`).
# `wan-diloco simulate --config` runs the same file on a virtual clock ([simulate] is only read there).

[run]
learners = 4
steps = 300                        # global step budget
batch_size = 8
seed = 0
eval_batches = 4
eval_batch_size = 8
host = "127.0.0.1"
port = 0                           # 0: any free port; the launcher passes it to the learners
status_port = 0                    # /status and /metrics of the syncer
run_dir = "runs"
eval_every_steps = 50              # the global model's held-out loss every 50 steps (loss.png, the table)

[model]
preset = "tiny"
seq_len = 64                       # shorter context than the preset's 128: 4 processes share 2 cores

[data]
corpus = "stdlib"                  # this Python's standard library, read as bytes
max_bytes = 4194304                # 4 MiB is plenty for 300 steps and keeps start-up quick

[learner]
sync_every = 8                     # H: each fragment syncs every 8 steps
num_fragments = 4                  # P: one fragment every 2 steps
tau = 2                            # a fragment may travel for 2 steps while training goes on

[syncer]
quorum = 1                         # K: merge as soon as one learner delivered (then the grace window)
merge = "rda"

[train]
lr = 3e-3
warmup_steps = 15

[codec]
bits = 8                           # int8 outer gradients and updates (4 = NF4, 32 = uncompressed)

[simulate]
step_time_s = 0.1                  # virtual seconds per step
bandwidth_gbit_s = 1.0

[regions]
names = ["us-east", "eu-west"]     # learner m runs in names[m % 2]; the syncer in the first
"""
