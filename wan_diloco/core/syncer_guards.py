"""The syncer's checks that refuse a message: functions of plain values, each raising ProtocolError
(naming the field) before the message changes any state. ``SyncerCore`` calls them in a fixed order,
so a message with several faults is refused for the same one every time; it counts the refusals.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core.pace import StepPace
from wan_diloco.core.protocol import SYNCER, FragmentUpload, Metadata, ProtocolError, Tensors, learner_node
from wan_diloco.core.refusals import QUARANTINED
from wan_diloco.core.syncer_config import SyncerConfig
from wan_diloco.fragments import tau_bounds
from wan_diloco.merge import Workers, sum_squares


MAX_CLOCK = 1 << 53  # vector-clock entries count events: no run gets near; far from int64's end
MAX_TIMING_S = 86_400.0  # a learner's measured step or sync time past a day is nonsense (it bounds the grace)
# A learner reports the newest snapshot it wrote a part of: never far past what this syncer cut (after a
# resume from an older snapshot the learner may still name a newer one of the last incarnation).
SNAPSHOT_LEEWAY = 1000
# A learner's own clock entry may advance this much per message (it ticks a few times a step; one that
# trained on alone for a long while, or through a syncer restart, sends many ticks at once) ...
CLOCK_ADVANCE = 1 << 20
# ... and name another learner at most this far past what the syncer knows of it (it learnt it from a
# peer's state at a recovery, or from another syncer shard, a little ahead of this one).
OTHER_CLOCK_SLACK = 1 << 16


def check_learner(learner: int, num_learners: int) -> None:
    if not isinstance(learner, int) or not 0 <= learner < num_learners:
        raise ProtocolError(f"learner id {learner!r} out of range 0..{num_learners - 1}", "learner")


def check_quarantine(now_s: float, learner: int, quarantined: Mapping[int, tuple[float, str]]) -> None:
    until, why = quarantined.get(learner, (0.0, ""))
    if now_s < until:
        raise ProtocolError(f"learner {learner} is quarantined for another {until - now_s:.0f} s: {why}", QUARANTINED)


def syncer_clock_limit(restored: int, ticks: int, leeway: int, shards_fragments: int | None) -> int:
    """The most of the syncer's own clock entry a learner may carry: what this core ticked since it
    started from ``restored`` (a resume), plus ``leeway``. ``shards_fragments``: P where this core is one
    syncer shard of several (learners carry every shard's ticks of this entry, about P times its own at
    most); None where it owns every fragment."""
    if shards_fragments is not None:
        return restored + ticks * shards_fragments + CLOCK_ADVANCE
    return restored + ticks + leeway


def check_clock(learner: int, clock: VectorClock, known: VectorClock, nodes: set[str], num_learners: int,
                syncer_limit: int) -> None:
    """Only this run's ``nodes`` (a clock naming others would ride on every later message), and no
    entry near the wire's int64 limit (the syncer's next tick would overflow it, and every update
    after would be refused on the way out). ``known``: the syncer's clock; ``syncer_limit``: its own
    entry's bound (``syncer_clock_limit``)."""
    huge = [n for n, v in clock.entries.items() if v > MAX_CLOCK]
    if huge:
        raise ProtocolError(f"vector clock from learner {learner}: entry {huge[0][:40]!r} = "
                            f"{clock[huge[0]]} is beyond {MAX_CLOCK}", "clock")
    unknown = sorted(set(clock.entries) - nodes)
    if unknown:
        raise ProtocolError(f"vector clock from learner {learner}: {len(unknown)} unknown node(s), e.g. "
                            f"{unknown[0][:40]!r}; this run has learner-0..learner-{num_learners - 1} "
                            f"and {SYNCER!r}", "clock")
    # No entry far past what the syncer issued or knows: merged into its clock, it would ride on every
    # update, and one near MAX_CLOCK would have every later message refused.
    own = learner_node(learner)
    for node, value in clock.entries.items():
        if node == own:
            limit = known[node] + CLOCK_ADVANCE
        elif node != SYNCER:
            limit = known[node] + OTHER_CLOCK_SLACK
        else:
            limit = syncer_limit
        if value > limit:
            raise ProtocolError(f"vector clock from learner {learner}: entry {node!r} = {value} is past what the "
                                f"syncer issued or knows ({limit})", "clock")


def check_metadata(cfg: SyncerConfig, msg: Metadata, now_s: float, pace: StepPace, global_step: int,
                   num_fragments: int, epoch: int, snapshot_id: int) -> None:
    """A learner's counters, after its identity, settings, quarantine and clock passed: its step
    within the run and its pace, counters for every fragment, τ within ``tau_bounds``, and
    ``check_metadata_counters``."""
    if cfg.max_step is not None and msg.step > cfg.max_step:
        raise ProtocolError(f"metadata from learner {msg.learner}: step {msg.step} beyond the run's "
                            f"{cfg.max_step} steps", "metadata.step")
    bound = pace.bound(msg.learner, now_s, global_step)
    if msg.step > bound:
        raise ProtocolError(f"metadata from learner {msg.learner}: step {msg.step} is past what its pace allows "
                            f"now ({bound}: global step {global_step}, syncer.step_slack "
                            f"{cfg.step_slack}, {pace.rate(msg.learner):.3g} steps/s)", "metadata.step")
    if len(msg.c_steps) != num_fragments or len(msg.c_tokens) != num_fragments:
        raise ProtocolError(f"metadata from learner {msg.learner}: counters for {len(msg.c_steps)} fragments, "
                            f"expected {num_fragments}", "metadata.counters")
    lo, hi = tau_bounds(cfg.sync_every, num_fragments)
    if msg.tau is not None and not lo <= msg.tau <= hi:
        raise ProtocolError(f"metadata from learner {msg.learner}: tau must be in [{lo}, {hi}] (below H = "
                            f"{cfg.sync_every}), got {msg.tau}", "metadata.tau")
    check_metadata_counters(cfg, msg, epoch, snapshot_id)


def check_metadata_counters(cfg: SyncerConfig, msg: Metadata, epoch: int, snapshot_id: int) -> None:
    """Counters and timings no honest learner reports: per-fragment steps past its step, tokens past
    its steps' worth, a negative or absurd step or sync time, an incarnation or snapshot this syncer
    never had."""
    m, step = msg.learner, msg.step
    tokens = cfg.max_tokens_per_step
    for name, c in (("c_steps", msg.c_steps), ("c_tokens", msg.c_tokens)):
        if any(x < 0 for x in c):
            raise ProtocolError(f"metadata from learner {m}: negative {name}", f"metadata.{name}")
    if max(msg.c_steps, default=0) > step:
        raise ProtocolError(f"metadata from learner {m}: c_steps {max(msg.c_steps)} past its step {step}",
                            "metadata.c_steps")
    if tokens is not None:
        worst = max((t - c * tokens for t, c in zip(msg.c_tokens, msg.c_steps)), default=0)
        if worst > 0:
            raise ProtocolError(f"metadata from learner {m}: c_tokens past {tokens} tokens a step "
                                "(syncer.max_tokens_per_step)", "metadata.c_tokens")
        if msg.tokens > (step + cfg.step_slack) * tokens:
            raise ProtocolError(f"metadata from learner {m}: {msg.tokens} tokens trained in {step} steps of "
                                f"at most {tokens}", "metadata.tokens")
    for name in ("step_s", "sync_s"):
        v = getattr(msg, name)
        if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_TIMING_S):
            raise ProtocolError(f"metadata from learner {m}: {name} must be in [0, {MAX_TIMING_S:g}] s, got {v}",
                                f"metadata.{name}")
    if msg.epoch > epoch:
        raise ProtocolError(f"metadata from learner {m}: incarnation {msg.epoch}, this syncer is at {epoch}",
                            "metadata.epoch")
    if msg.snapshot > snapshot_id + SNAPSHOT_LEEWAY:
        raise ProtocolError(f"metadata from learner {m}: snapshot {msg.snapshot}, this syncer cut "
                            f"{snapshot_id}", "metadata.snapshot")


def check_upload(cfg: SyncerConfig, msg: FragmentUpload, owned: Sequence[int], epoch: int, version: Sequence[int],
                 theta: Sequence[Tensors]) -> None:
    """A fragment upload's fields, after its clock passed: step within the run, a fragment this core
    owns, counters and incarnation no honest learner exceeds, a base version this syncer issued, and
    Δ's tensor names and shapes those of Θ_p (``theta[p]``; ``version[p]`` its version). NaN and Inf
    are refused by ``delta_sum_squares``, in the same pass as the norm."""
    if cfg.max_step is not None and msg.due_step > cfg.max_step:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: due step {msg.due_step} beyond the "
                            f"run's {cfg.max_step} steps", "upload.due_step")
    if not 0 <= msg.fragment < len(theta):
        raise ProtocolError(f"fragment {msg.fragment} out of range 0..{len(theta) - 1}", "upload.fragment")
    if msg.fragment not in owned:
        raise ProtocolError(f"fragment {msg.fragment} from learner {msg.learner}: this syncer shard owns "
                            f"fragments {list(owned)} only (a learner with another shard plan?)",
                            "upload.fragment")
    if msg.c_steps < 0 or msg.c_tokens < 0 or msg.due_step < 1 or msg.base_version < 0:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: negative counters or step",
                            "upload.counters")
    if msg.c_steps > msg.due_step + cfg.step_slack:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: c_steps {msg.c_steps} past its due step "
                            f"{msg.due_step}", "upload.c_steps")
    tokens = cfg.max_tokens_per_step
    if tokens is not None and msg.c_tokens > msg.c_steps * tokens:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: {msg.c_tokens} tokens in {msg.c_steps} "
                            f"steps of at most {tokens} (syncer.max_tokens_per_step)", "upload.c_tokens")
    if msg.epoch > epoch:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: incarnation {msg.epoch}, this syncer is "
                            f"at {epoch}", "upload.epoch")
    if msg.final and cfg.final_min_step is not None and msg.due_step < cfg.final_min_step:
        raise ProtocolError(f"fragment upload from learner {msg.learner}: final at step {msg.due_step}, before the "
                            f"run's {cfg.final_min_step} steps", "upload.final")
    if msg.epoch in (0, epoch) and msg.base_version > version[msg.fragment]:
        # Versions come from this syncer only (an earlier incarnation's are told apart by epoch).
        raise ProtocolError(f"fragment upload from learner {msg.learner}: base version {msg.base_version} of "
                            f"fragment {msg.fragment} is past its current version {version[msg.fragment]}",
                            "upload.base_version")
    frag = theta[msg.fragment]
    if set(msg.delta) != set(frag):
        missing = sorted(set(frag) - set(msg.delta))[:2]
        extra = sorted(set(msg.delta) - set(frag))[:2]
        raise ProtocolError(f"fragment {msg.fragment} from learner {msg.learner}: missing {missing}, "
                            f"unexpected {extra}", "upload.tensors")
    shapes = getattr(msg.delta, "shapes", None)  # a Δ still in its codes (``compression.coded``) knows them
    for n in msg.delta:
        shape = tuple(shapes[n]) if isinstance(shapes, Mapping) else np.shape(msg.delta[n])
        if shape != frag[n].shape:
            raise ProtocolError(f"{n!r} from learner {msg.learner}: shape {shape}, expected {frag[n].shape}",
                                "upload.shape")


def delta_sum_squares(msg: FragmentUpload, workers: Workers) -> np.ndarray:
    """||Δ_t||² of each tensor of an upload (float64, in ``msg.delta``'s order); NaN or Inf in Δ refused
    (it makes its sum of squares non-finite, so one pass over Δ serves both the finiteness and the
    norm check). A Δ the codec decoded carries its sums from the decoding pass (``Decoded``): no
    second pass over it here."""
    sq = getattr(msg.delta, "sum_squares", None)
    if sq is None or len(sq) != len(msg.delta):
        sq = sum_squares(list(msg.delta.values()), workers)
    if not np.all(np.isfinite(sq)):
        bad = next(n for n, x in zip(msg.delta, sq) if not math.isfinite(x))
        raise ProtocolError(f"{bad!r} from learner {msg.learner}: NaN or Inf in the outer gradient", "upload.delta")
    return np.asarray(sq, np.float64)


def norm_excess(p: int, delta_sq: float, theta_sq: float, max_delta_ratio: float) -> str | None:
    """Why an outer gradient of fragment ``p`` is absurd (``SyncerConfig.max_delta_ratio``), or None."""
    delta, theta = math.sqrt(delta_sq), math.sqrt(theta_sq)
    limit = max_delta_ratio * max(theta, 1.0)
    if delta > limit:
        return (f"outer gradient of fragment {p} has norm {delta:.3g}, over {max_delta_ratio:g}"
                f" x max(|Theta|, 1) = {limit:.3g}")
    return None
