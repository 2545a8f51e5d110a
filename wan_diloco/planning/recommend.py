"""Recommend streaming settings (H, P, τ, bits) that reach a CU target on a given link."""
from __future__ import annotations

import dataclasses
import math

from wan_diloco.compression.config import BITS
from wan_diloco.config import replace, require
from wan_diloco.fragments import tau_bounds
from wan_diloco.planning.bandwidth import BandwidthConfig, schedule_for
from wan_diloco.planning.timeline import compute_utilization

SYNC_EVERY_OPTIONS = (10, 25, 50, 100, 200, 500)
LAYERS_PER_FRAGMENT_OPTIONS = (1, 2, 3, 4, 6, 8, 12)
TAU_OPTIONS = (0, 1, 2, 3, 4, 5)  # τ <= 5 is the published safe range
BITS_OPTIONS = tuple(b for b in BITS if b < 32)  # the codec's widths below fp32: (16, 8, 4)
STREAMING_METHODS = ("decoupled", "streaming_overlap")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """One setting and the compute utilization it reaches on the link."""

    sync_every: int
    fragments: int
    tau: int
    bits: int
    cu: float


def _quality_key(r: Recommendation) -> tuple:
    # Model quality prefers frequent syncs, then little staleness; 4-bit outer
    # gradients cost no quality in Streaming DiLoCo, so width only breaks ties.
    return (r.sync_every, r.tau, -r.bits, -r.cu, r.fragments)


def recommend(
    cfg: BandwidthConfig, link_gbit_s: float, target_cu: float, method: str = "decoupled"
) -> tuple[list[Recommendation], bool]:
    """Settings of ``method`` on a ``link_gbit_s`` link, best first.

    Returns ``(settings, reached)``. When some settings reach ``target_cu``,
    they are all returned ordered by a model-quality preference (smaller H,
    then smaller τ, then more bits) and ``reached`` is True; otherwise every setting is
    returned ordered by CU, highest first, and ``reached`` is False.
    """
    cfg.validate()
    require(link_gbit_s > 0, "link_gbit", f"must be > 0, got {link_gbit_s}")
    require(0 < target_cu < 1, "target_cu", f"must be in (0, 1), got {target_cu}")
    require(method in STREAMING_METHODS, "method", f"recommendations cover {', '.join(STREAMING_METHODS)}, got {method!r}")
    fragment_counts = sorted({math.ceil(cfg.layers / k) for k in LAYERS_PER_FRAGMENT_OPTIONS if k <= cfg.layers})
    found = []
    for h in SYNC_EVERY_OPTIONS:
        for p in fragment_counts:
            lo, hi = tau_bounds(h, p)  # the run's rule: τ < H
            for tau in TAU_OPTIONS:
                if not lo <= tau <= hi:
                    continue
                for bits in BITS_OPTIONS:
                    c = replace(cfg, sync_every=h, fragments=p, tau=tau, bits=bits)
                    found.append(Recommendation(h, p, tau, bits, compute_utilization(schedule_for(c, method), link_gbit_s)))
    ok = [r for r in found if r.cu >= target_cu]
    if ok:
        return sorted(ok, key=_quality_key), True
    return sorted(found, key=lambda r: -r.cu), False
