"""One TOML file describes a networked run: every process (syncer, learners, launcher) reads the same one.

Tables: ``[run]`` (M, regions, budget, data, addresses), ``[model]`` (a preset
plus optional explicit dimensions), ``[learner]`` (:class:`LearnerConfig`),
``[syncer]`` (:class:`SyncerConfig`; ``num_learners`` and ``tau`` default to
the run's), ``[train]`` (:class:`TrainConfig`; ``total_steps`` defaults to the
step budget) and ``[transport]`` (:class:`TransportConfig`, with an optional
``[transport.tls]``). The bearer token comes from ``run.token`` or the
``WAN_DILOCO_TOKEN`` environment variable.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

from wan_diloco import model as model_lib
from wan_diloco.compression.config import CodecConfig
from wan_diloco.config import from_mapping, load_toml, require
from wan_diloco.core import LearnerConfig, SyncerConfig
from wan_diloco.fragments import STRATEGIES
from wan_diloco.model import ModelConfig
from wan_diloco.train import TrainConfig
from wan_diloco.transport import TransportConfig

TOKEN_ENV = "WAN_DILOCO_TOKEN"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the processes of one run share besides the protocol settings."""

    learners: int = 4  # M
    regions: tuple[str, ...] = ("region-a", "region-b")  # learner m lives in regions[m % len(regions)]
    steps: int = 200  # global step budget
    batch_size: int = 8
    seed: int = 0
    corpus: str = "stdlib"
    corpus_max_bytes: int = 4 * 2**20  # bytes of corpus read at startup
    eval_batches: int = 4
    fragmenter: str = "balanced"
    host: str = "127.0.0.1"  # syncer bind address
    port: int = 0  # syncer gRPC port; 0 picks a free one (the launcher tells the learners)
    status_port: int = 0  # syncer /status and /metrics; 0 picks a free one, -1 disables
    token: str = ""  # bearer token; empty: taken from $WAN_DILOCO_TOKEN
    tick_s: float = 1.0  # liveness check period of the syncer
    final_timeout_s: float = 60.0  # syncer: final sync goes ahead without learners this late
    report_every_s: float = 0.5  # progress lines on stdout at most this often
    min_step_s: float = 0.0  # learners pace their steps to at least this long (emulates slower chips)
    run_dir: str = "runs"  # launcher: where metrics.jsonl and logs go

    def validate(self) -> None:
        require(self.learners >= 1, "learners", f"must be >= 1, got {self.learners}")
        require(len(self.regions) >= 1 and all(self.regions), "regions", "need at least one non-empty region name")
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.corpus_max_bytes >= 1 << 16, "corpus_max_bytes", "must be >= 65536")
        require(self.eval_batches >= 1, "eval_batches", "must be >= 1")
        require(self.fragmenter in STRATEGIES, "fragmenter", f"must be one of {', '.join(STRATEGIES)}")
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(-1 <= self.status_port < 65536, "status_port", "must be -1 (off) or a port, 0 for any")
        require(self.min_step_s >= 0, "min_step_s", f"must be >= 0, got {self.min_step_s}")
        require(self.tick_s > 0 and self.final_timeout_s > 0 and self.report_every_s > 0, "tick_s",
                "tick_s, final_timeout_s and report_every_s must be > 0")

    def region(self, learner: int) -> str:
        return self.regions[learner % len(self.regions)]


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    run: RunConfig
    model: ModelConfig
    learner: LearnerConfig
    syncer: SyncerConfig
    train: TrainConfig
    transport: TransportConfig
    codec: CodecConfig = CodecConfig(bits=32)

    def token(self) -> str:
        """The bearer token: ``run.token``, else ``$WAN_DILOCO_TOKEN``; a missing one is a ConfigError."""
        token = self.run.token or os.environ.get(TOKEN_ENV, "")
        require(bool(token), "run.token", f"no bearer token: set run.token or the {TOKEN_ENV} environment variable")
        return token


def _model(table: Mapping[str, Any]) -> ModelConfig:
    table = dict(table)
    base = model_lib.preset(str(table.pop("preset", "tiny")))
    return from_mapping(ModelConfig, {**dataclasses.asdict(base), **table}, prefix="model.")


def _table(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name, {})
    require(isinstance(value, Mapping), name, f"must be a table, got {type(value).__name__}")
    return dict(value)


def from_document(doc: Mapping[str, Any]) -> RuntimeConfig:
    """Build and cross-check the whole config from a parsed TOML document."""
    known = {"run", "model", "learner", "syncer", "train", "transport", "codec"}
    unknown = sorted(set(doc) - known)
    require(not unknown, unknown[0] if unknown else "", f"unknown table; known tables are {', '.join(sorted(known))}")
    run = from_mapping(RunConfig, _table(doc, "run"), prefix="run.")
    learner = from_mapping(LearnerConfig, _table(doc, "learner"), prefix="learner.")
    syncer_t = _table(doc, "syncer")
    syncer_t.setdefault("num_learners", run.learners)
    syncer_t.setdefault("tau", learner.tau)
    syncer = from_mapping(SyncerConfig, syncer_t, prefix="syncer.")
    require(syncer.num_learners == run.learners, "syncer.num_learners",
            f"{syncer.num_learners} differs from run.learners = {run.learners}")
    train_t = _table(doc, "train")
    train_t.setdefault("total_steps", max(run.steps, train_t.get("warmup_steps", TrainConfig.warmup_steps) + 1))
    train = from_mapping(TrainConfig, train_t, prefix="train.")
    transport = from_mapping(TransportConfig, _table(doc, "transport"), prefix="transport.")
    codec_t = _table(doc, "codec")
    codec_t.setdefault("bits", 32)
    codec = from_mapping(CodecConfig, codec_t, prefix="codec.")
    return RuntimeConfig(run, _model(_table(doc, "model")), learner, syncer, train, transport, codec)


def load(path: str | Path | None) -> RuntimeConfig:
    """The config in ``path``; None gives the embedded default (``examples/local.toml``)."""
    if path is None:
        import tomllib

        return from_document(tomllib.loads(DEFAULT_TOML))
    return from_document(load_toml(path))


# The embedded default of `wan-diloco train`, also written out as examples/local.toml.
# Sized so 4 JAX learners sharing 2 CPU cores show a falling loss within ~3 minutes.
DEFAULT_TOML = """\
# wan-diloco: syncer + 4 learners in 2 regions on loopback (the default of `wan-diloco train`).

[run]
learners = 4
regions = ["us-east", "eu-west"]   # learner m runs in regions[m % 2]
steps = 300                        # global step budget
batch_size = 8
seed = 0
corpus = "stdlib"                  # this Python's standard library, read as bytes
eval_batches = 4
host = "127.0.0.1"
port = 0                           # 0: any free port; the launcher passes it to the learners
status_port = 0                    # /status and /metrics of the syncer
run_dir = "runs"

[model]
preset = "tiny"
seq_len = 64                       # shorter context than the preset's 128: 4 processes share 2 cores

[learner]
sync_every = 8                     # H: each fragment syncs every 8 steps
num_fragments = 4                  # P: one fragment every 2 steps
tau = 2                            # a fragment may travel for 2 steps while training goes on

[syncer]
quorum = 1                         # K: merge as soon as one learner delivered (then the grace window)
merge = "rda"

[syncer.outer]                     # tuned for tiny models (README, "Model quality")
lr = 0.4
momentum = 0.6

[train]
lr = 3e-3
warmup_steps = 15

[transport]
channels = 1

[codec]
bits = 8                           # int8 outer gradients and updates (4 = NF4, 32 = uncompressed)
"""
