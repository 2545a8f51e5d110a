"""Configuration of one simulated run (see wan_diloco.sim)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wan_diloco import model as model_lib
from wan_diloco.config import require
from wan_diloco.core import Codec, Float32Codec, LearnerConfig, SyncerConfig
from wan_diloco.fragments import STRATEGIES
from wan_diloco.outer import OuterConfig

Baseline = Literal["dp", "diloco", "streaming", "decoupled"]
BASELINES = ("dp", "diloco", "streaming", "decoupled")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are virtual seconds; ``speeds`` are step-time factors (1.2 = 20 % slower)."""

    preset: str = "tiny"
    baseline: Baseline = "decoupled"
    learners: int = 4
    quorum: int = 1
    grace: bool = True
    fragments: int = 4
    sync_every: int = 8
    tau: int = 2
    alpha: float = 0.0
    keep_local: bool = False  # keep the steps taken while a fragment travelled (core LearnerConfig.keep_local)
    merge: Literal["rda", "mean"] = "rda"
    fragmenter: Literal["layer", "tensor", "balanced"] = "balanced"
    steps: int = 300  # global step budget
    tokens: int = 0  # if > 0, a token budget (all learners together) replaces the step budget
    batch_size: int = 16
    inner_lr: float = 3e-3
    warmup_steps: int = 50
    # Tuned for the tiny preset at 1–2M tokens, batch 16 and batch 2 (bench/quality_sweep.py);
    # DiLoCo's published 0.7 / 0.9 ended 19–27 % above data parallel there.
    outer_lr: float = 0.4
    outer_momentum: float = 0.6
    speeds: tuple[float, ...] = ()
    step_noise: float = 0.0  # sigma of the lognormal step-time noise
    step_time_s: float = 0.5
    bandwidth_gbit_s: float = 0.1  # per learner link, each direction
    rtt_s: float = 0.06
    seed: int = 0
    eval_every: int = 50  # global steps between eval points on the curve
    eval_batches: int = 8
    # The eval set (eval_batches x eval_batch_size windows) does not shrink with the training batch.
    eval_batch_size: int = 16
    corpus: str = "stdlib"
    # 0: contiguous shards (learners see different files); > 0: blocks of this many tokens dealt round-robin.
    shard_block_tokens: int = 0
    # Live learners also read the shards of learners that are down, so no shard drops out of the mix
    # while its learner is away (data.FailoverBatches). Off: a down learner's data waits for it.
    data_failover: bool = True
    bits: int = 32  # outer gradients and updates on the wire: 32 (fp32), 16 (bf16), 8 (int8), 4 (NF4)
    error_feedback: bool = False

    def validate(self) -> None:
        require(self.bits in (32, 16, 8, 4), "bits", f"must be 32, 16, 8 or 4, got {self.bits}")
        require(self.baseline in BASELINES, "baseline", f"must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        require(self.learners >= 1, "learners", f"must be >= 1, got {self.learners}")
        require(1 <= self.quorum <= self.learners, "quorum", f"must be in 1..learners ({self.learners}), got {self.quorum}")
        require(self.fragments >= 1, "fragments", f"must be >= 1, got {self.fragments}")
        require(self.sync_every >= 1, "sync_every", f"must be >= 1, got {self.sync_every}")
        require(self.tau >= 0, "tau", f"must be >= 0, got {self.tau}")
        require(0.0 <= self.alpha <= 1.0, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(self.fragmenter in STRATEGIES, "fragmenter", f"must be one of {', '.join(STRATEGIES)}")
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(self.tokens >= 0, "tokens", f"must be >= 0, got {self.tokens}")
        require(self.shard_block_tokens >= 0, "shard_block_tokens", f"must be >= 0, got {self.shard_block_tokens}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(not self.speeds or len(self.speeds) == self.learners, "speeds",
                f"needs one factor per learner ({self.learners}), got {len(self.speeds)}")
        require(all(s > 0 for s in self.speeds), "speeds", "factors must be > 0")
        require(self.step_noise >= 0, "step_noise", "must be >= 0")
        require(self.step_time_s > 0, "step_time_s", "must be > 0")
        require(self.bandwidth_gbit_s > 0, "bandwidth_gbit_s", "must be > 0")
        require(self.rtt_s >= 0, "rtt_s", "must be >= 0")
        require(self.eval_every >= 1 and self.eval_batches >= 1, "eval_every", "eval_every and eval_batches must be >= 1")
        require(self.eval_batch_size >= 1, "eval_batch_size", f"must be >= 1, got {self.eval_batch_size}")
        model_lib.preset(self.preset)
        OuterConfig(self.outer_lr, self.outer_momentum).validate()

    def learner_config(self) -> LearnerConfig:
        """The baselines are settings of the same protocol (SPEC §5: K = M is synchronous DiLoCo)."""
        if self.baseline == "diloco":  # whole model every H steps, blocking
            return LearnerConfig(self.sync_every, 1, tau=0, alpha=self.alpha, blocking=True,
                                 error_feedback=self.error_feedback)
        blocking = self.baseline == "streaming"
        return LearnerConfig(self.sync_every, self.fragments, tau=self.tau, alpha=self.alpha, blocking=blocking,
                             error_feedback=self.error_feedback, keep_local=self.keep_local)

    def codec(self) -> Codec:
        if self.bits == 32:
            return Float32Codec()
        from wan_diloco.compression import CodecConfig
        from wan_diloco.compression.fragment_codec import FragmentCodec

        return FragmentCodec(CodecConfig(bits=self.bits))

    def syncer_config(self) -> SyncerConfig:
        sync = self.baseline in ("diloco", "streaming")
        return SyncerConfig(
            num_learners=self.learners, quorum=self.learners if sync else self.quorum,
            grace=self.grace and not sync, tau=self.learner_config().tau, merge=self.merge,
            outer=OuterConfig(self.outer_lr, self.outer_momentum),
        )
