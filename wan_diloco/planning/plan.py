"""Plan a Decoupled DiLoCo run from its measured links: bits, H, P, τ, grace window and fragment order.

Inputs are what a run can know before (or while) it trains: the model's size,
the step time of one learner, and per region the rate and round-trip time of
its WAN link to the syncer's region. The plan searches the option grids of
:mod:`~wan_diloco.planning.recommend` and keeps the settings that pass three
checks on every region's link:

* **demand**: the wire bits the region's learners move per second in each
  direction stay under ``rate·(1 − margin)``;
* **τ rule**: one fragment's round trip fits in τ steps (:func:`tau_for_link`),
  with 1 <= τ within the run's bounds (:func:`wan_diloco.fragments.tau_bounds`:
  τ < H) and at most ``max_tau``;
* **CU**: the compute utilization of ``wan-diloco bandwidth``'s model
  (:func:`~wan_diloco.planning.bandwidth.schedule_for` with method
  ``"decoupled"``, then :func:`~wan_diloco.planning.timeline.compute_utilization`)
  reaches the target at the bottleneck link. There is one model, not two.

Among the plans that pass, the preference is recommend's: smaller H, then
smaller τ, then more bits. Formulas and choices: docs/planning.md, "Planning a
run from its links".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from wan_diloco.compression.config import BITS
from wan_diloco.config import require
from wan_diloco.fragments import Schedule, tau_bounds
from wan_diloco.planning.bandwidth import BandwidthConfig, fragment_layers, schedule_for
# The links and what one fragment's round trip over them takes: planning.links (re-exported here).
from wan_diloco.planning.links import (  # noqa: F401
    REPLAN_THRESHOLD, LinkEstimate, confirmed_move, links_from_metrics, replan_reasons, round_trip_s, tau_for_link,
)
from wan_diloco.planning.recommend import BITS_OPTIONS, LAYERS_PER_FRAGMENT_OPTIONS, SYNC_EVERY_OPTIONS, TAU_OPTIONS
from wan_diloco.planning.timeline import compute_utilization, min_rate_for_cu

METHOD = "decoupled"
DEFAULT_MAX_TAU = max(TAU_OPTIONS)  # τ <= 5 is the published safe range
DEFAULT_GRACE_SAFETY = 0.8  # γ, as the syncer's own grace_safety default


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about the model.

    ``fragment_params``: parameters of each fragment as the run's fragmenter
    cuts them at P = ``len(fragment_params)``. At any other P (and when it is
    None) fragments are taken as the bandwidth model cuts them: consecutive
    layers of ``params / layers`` parameters each.
    """

    params: int
    layers: int
    fragment_params: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("params", "layers"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
                    f"must be an integer >= 1, got {v!r}")
        frag = self.fragment_params
        if frag is not None:
            require(len(frag) >= 1, "fragment_params", "must list at least one fragment")
            require(all(isinstance(n, int) and n >= 0 for n in frag), "fragment_params",
                    f"must be integers >= 0, got {list(frag)}")
            require(sum(frag) == self.params, "fragment_params",
                    f"must add up to params={self.params}, got {sum(frag)}")

    def fragment_sizes(self, fragments: int) -> tuple[float, ...]:
        """Parameters of each of ``fragments`` fragments."""
        if self.fragment_params is not None and len(self.fragment_params) == fragments:
            return tuple(float(n) for n in self.fragment_params)
        per_layer = self.params / self.layers
        return tuple(per_layer * len(group) for group in fragment_layers(self.layers, fragments))


def fragment_order(sizes: Sequence[float], sync_every: int) -> tuple[int, ...]:
    """Which fragment goes on the wire in each of the P send slots of a period (slot k sends ``order[k]``).

    Slots sit at offsets ⌊k·H/P⌋ (:class:`wan_diloco.fragments.Schedule`, which
    applies the order when a run sets ``learner.fragment_order`` to it), so when
    P does not divide H the gaps to the next send differ by one step. The largest fragment goes to the slot
    followed by the longest gap, and so on down: the transfers that take
    longest get the most time before the link is needed again. Fragments of
    equal size keep their index order among themselves.
    """
    n = len(sizes)
    offsets = [Schedule.slot_offset(k, sync_every, n) for k in range(n)]
    gaps = [(offsets[k + 1] if k + 1 < n else sync_every + offsets[0]) - offsets[k] for k in range(n)]
    slots = sorted(range(n), key=lambda k: (-gaps[k], k))
    frags = sorted(range(n), key=lambda p: (-sizes[p], p))
    order = [0] * n
    for slot, p in zip(slots, frags):
        order[slot] = p
    # Fragments of equal size gain nothing from trading slots: keep them in index order.
    by_size: dict[float, list[int]] = {}
    for slot in range(n):
        by_size.setdefault(sizes[order[slot]], []).append(slot)
    for group in by_size.values():
        for slot, p in zip(group, sorted(order[k] for k in group)):
            order[slot] = p
    return tuple(order)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The settings chosen for a run and what they are predicted to give.

    Per region (WAN regions with learners only): ``tau_by_region`` the
    smallest τ its own link allows, ``demand_gbit_s_by_region`` the average
    bits its learners move each way, ``cu_by_region`` the CU its learners
    reach with the global ``tau``. ``fragment_bytes`` is the largest fragment
    on the wire at ``bits``; ``bottleneck`` the region of the lowest CU.
    """

    bits: int
    sync_every: int
    fragments: int
    tau: int
    tau_by_region: dict[str, int | None]
    max_grace_s: float
    fragment_order: tuple[int, ...]
    fragment_params: tuple[float, ...]
    fragment_bytes: float
    demand_gbit_s_by_region: dict[str, float]
    cu_by_region: dict[str, float]
    cu_predicted: float
    bottleneck: str
    reached: bool
    why: tuple[str, ...]
    notes: tuple[str, ...]
    links: dict[str, LinkEstimate]
    learners_per_region: dict[str, int]
    params: int
    layers: int
    step_time_s: float
    target_cu: float
    margin: float
    grace_safety: float

    def bandwidth_config(self, region: str) -> BandwidthConfig:
        """The ``wan-diloco bandwidth`` model of ``region``'s learners under this plan."""
        return bandwidth_config(self.params, self.layers, self.step_time_s, self.sync_every, self.fragments,
                                self.tau, self.bits, self.links[region].rtt_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: links as {region: {rate_gbit_s, rtt_s}}, tuples as lists."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "links":
                v = {r: dataclasses.asdict(link) for r, link in v.items()}
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, dict):
                v = dict(v)
            out[f.name] = v
        return out


def bandwidth_config(params: float, layers: int, step_time_s: float, sync_every: int, fragments: int, tau: int,
                     bits: int, rtt_s: float) -> BandwidthConfig:
    """The ``wan-diloco bandwidth`` configuration of one region's link under a setting.

    ``datacenters`` stays at 2: the hub (decoupled) schedule does not depend on
    it, each learner's link is modelled on its own.
    """
    return BandwidthConfig(params=params, layers=layers, step_time_s=step_time_s, datacenters=2,
                           sync_every=sync_every, fragments=fragments, tau=tau, bits=bits, rtt_s=rtt_s)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    sync_every: int
    fragments: int
    bits: int
    tau: int
    tau_by_region: dict[str, int | None]
    cu_by_region: dict[str, float]
    demand_ok: bool
    tau_ok: bool

    @property
    def cu(self) -> float:
        return min(self.cu_by_region.values())

    def reached(self, target_cu: float) -> bool:
        return self.demand_ok and self.tau_ok and self.cu >= target_cu


def _quality_key(c: _Candidate) -> tuple:
    # As recommend's: model quality prefers frequent syncs, then little staleness;
    # 4-bit outer gradients cost no quality in Streaming DiLoCo, so width only breaks ties.
    return (c.sync_every, c.tau, -c.bits, -c.cu, c.fragments)


def plan_run(
    model: ModelFacts,
    links: Mapping[str, LinkEstimate],
    step_time_s: float,
    learners_per_region: Mapping[str, int],
    target_cu: float = 0.95,
    margin: float = 0.1,
    bits_options: Sequence[int] = BITS_OPTIONS,
    sync_every_options: Sequence[int] = SYNC_EVERY_OPTIONS,
    fragment_options: Sequence[int] | None = None,
    max_tau: int = DEFAULT_MAX_TAU,
    quorum_s: float = 0.0,
    sync_s: float = 0.0,
    grace_safety: float = DEFAULT_GRACE_SAFETY,
) -> Plan:
    """The preferred setting that passes demand, τ rule and CU target on every region's link.

    ``links``: each WAN region's link to the syncer's region.
    ``learners_per_region``: learners in each region; those of a region
    without a link (the syncer's own, on its LAN) are not planned for, and
    links of regions without learners are ignored. The ``n`` learners of a
    region share its link, each at ``rate / n``. ``fragment_options`` defaults
    to recommend's (one fragment per 1, 2, 3, 4, 6, 8 or 12 layers).

    When no setting passes, the returned plan is the one of highest CU (ties:
    the preference order) with ``reached=False`` and ``why`` saying which link
    falls short of what, and by how much.
    """
    require(step_time_s > 0 and math.isfinite(step_time_s), "step_time_s",
            f"must be a finite number > 0, got {step_time_s}")
    require(0 < target_cu < 1, "target_cu", f"must be in (0, 1), got {target_cu}")
    require(0 <= margin < 1, "margin", f"must be in [0, 1), got {margin}")
    require(bool(bits_options) and all(b in BITS for b in bits_options), "bits_options",
            f"each must be one of {', '.join(map(str, BITS))}, got {list(bits_options)}")
    require(bool(sync_every_options) and all(isinstance(h, int) and h >= 2 for h in sync_every_options),
            "sync_every_options", f"each must be an integer >= 2, got {list(sync_every_options)}")
    require(isinstance(max_tau, int) and max_tau >= 1, "max_tau", f"must be an integer >= 1, got {max_tau!r}")
    require(quorum_s >= 0, "quorum_s", f"must be >= 0, got {quorum_s}")
    require(sync_s >= 0, "sync_s", f"must be >= 0, got {sync_s}")
    require(0 < grace_safety < 1, "grace_safety", f"must be in (0, 1), got {grace_safety}")
    for r, link in links.items():
        require(isinstance(link, LinkEstimate), f"links.{r}", f"must be a LinkEstimate, got {type(link).__name__}")
    for r, n in learners_per_region.items():
        require(isinstance(n, int) and n >= 0, f"learners_per_region.{r}", f"must be an integer >= 0, got {n!r}")
    planned = {r: n for r, n in learners_per_region.items() if n > 0 and r in links}
    require(bool(planned), "links",
            f"no region has both learners and a WAN link (links: {sorted(links)}, "
            f"learners: { {r: n for r, n in learners_per_region.items() if n} })")
    notes = [f"{r}: {n} learner(s) without a WAN link (the syncer's LAN), not planned for"
             for r, n in learners_per_region.items() if n > 0 and r not in links]
    notes += [f"{r}: link ignored, no learners there" for r in links if r not in planned]
    share = {r: links[r].shared_by(n) for r, n in planned.items()}

    if fragment_options is None:
        fragment_options = sorted({math.ceil(model.layers / k)
                                   for k in LAYERS_PER_FRAGMENT_OPTIONS if k <= model.layers})
    require(bool(fragment_options) and all(isinstance(p, int) and 1 <= p <= model.layers for p in fragment_options),
            "fragment_options", f"each must be an integer in [1, layers={model.layers}], got {list(fragment_options)}")

    found: list[_Candidate] = []
    for h in sorted(sync_every_options):
        for p in sorted(fragment_options):
            # The run's bounds, at most max_tau; τ >= 1 (overlap: the learner never blocks).
            _, cap = tau_bounds(h, p, max_tau)
            if cap < 1:
                continue
            sizes = model.fragment_sizes(p)
            for bits in bits_options:
                frag_bytes = max(sizes) * bits / 8
                taus = {r: tau_for_link(frag_bytes, share[r], step_time_s, margin, quorum_s, sync_s, cap)
                        for r in planned}
                demand_ok = all(_demand_gbit_s(model.params, bits, h, step_time_s, n)
                                <= links[r].rate_gbit_s * (1 - margin) for r, n in planned.items())
                tau_ok = all(t is not None for t in taus.values())
                tau_lo = max(t for t in taus.values()) if tau_ok else cap
                for tau in range(tau_lo, cap + 1):
                    cus = {r: compute_utilization(schedule_for(bandwidth_config(
                        model.params, model.layers, step_time_s, h, p, tau, bits, share[r].rtt_s), METHOD),
                        share[r].rate_gbit_s) for r in planned}
                    c = _Candidate(h, p, bits, tau, taus, cus, demand_ok, tau_ok)
                    found.append(c)
                    if c.reached(target_cu):
                        break  # a larger τ only adds staleness
    require(bool(found), "sync_every_options",
            f"no setting has 1 <= τ < H (H in {list(sync_every_options)}, P in {list(fragment_options)})")
    ok = [c for c in found if c.reached(target_cu)]
    if ok:
        best, reached = min(ok, key=_quality_key), True
    else:
        best, reached = min(found, key=lambda c: (-c.cu, (not c.tau_ok) + (not c.demand_ok), _quality_key(c))), False
    return _make_plan(best, reached, model, links, planned, share, step_time_s, target_cu, margin,
                      quorum_s, sync_s, grace_safety, notes)


def _demand_gbit_s(params: float, bits: int, sync_every: int, step_time_s: float, learners: int) -> float:
    # Every H steps each learner sends every fragment up once and gets it back down once:
    # per direction, all parameters at `bits` per H·step, times the learners sharing the link.
    return learners * params * bits / (sync_every * step_time_s) / 1e9


def _make_plan(c: _Candidate, reached: bool, model: ModelFacts, links, planned, share, step_time_s, target_cu,
               margin, quorum_s, sync_s, grace_safety, notes) -> Plan:
    sizes = model.fragment_sizes(c.fragments)
    frag_bytes = max(sizes) * c.bits / 8
    usable_s = c.tau * step_time_s * (1 - margin)
    need = {r: round_trip_s(frag_bytes, share[r], quorum_s, sync_s) for r in planned}
    # The grace window delays the merged fragment for everyone, so it must fit in the
    # smallest slack of any link: γ·min_r(τ·step·(1 − margin) − round trip_r), at least 0.
    max_grace_s = grace_safety * max(0.0, min(usable_s - s for s in need.values()))
    demand = {r: _demand_gbit_s(model.params, c.bits, c.sync_every, step_time_s, n) for r, n in planned.items()}
    bottleneck = min(planned, key=lambda r: (c.cu_by_region[r], share[r].rate_gbit_s, r))
    why = [] if reached else _why(c, model, links, planned, share, need, demand, usable_s, step_time_s,
                                  target_cu, margin)
    if model.fragment_params is not None and len(model.fragment_params) != c.fragments:
        notes = notes + [f"fragment sizes at P={c.fragments} taken as equal layers (given sizes are for "
                         f"P={len(model.fragment_params)})"]
    return Plan(
        bits=c.bits, sync_every=c.sync_every, fragments=c.fragments, tau=c.tau, tau_by_region=dict(c.tau_by_region),
        max_grace_s=max_grace_s, fragment_order=fragment_order(sizes, c.sync_every), fragment_params=sizes,
        fragment_bytes=frag_bytes, demand_gbit_s_by_region=demand, cu_by_region=dict(c.cu_by_region),
        cu_predicted=c.cu, bottleneck=bottleneck, reached=reached, why=tuple(why), notes=tuple(notes),
        links={r: links[r] for r in planned}, learners_per_region=dict(planned), params=model.params,
        layers=model.layers, step_time_s=step_time_s, target_cu=target_cu, margin=margin, grace_safety=grace_safety)


def _why(c: _Candidate, model, links, planned, share, need, demand, usable_s, step_time_s, target_cu,
         margin) -> list[str]:
    setting = f"H={c.sync_every}, P={c.fragments}, tau={c.tau}, {c.bits}-bit"
    out = []
    for r, n in planned.items():
        each = f" per learner ({n} share the link)" if n > 1 else ""
        limit = links[r].rate_gbit_s * (1 - margin)
        if demand[r] > limit:
            out.append(f"{r}: demand {demand[r]:.3g} Gbit/s each way exceeds rate x (1 - margin) = {limit:.3g} "
                       f"Gbit/s by {100 * (demand[r] / limit - 1):.0f} % at {setting}")
        if c.tau_by_region[r] is None:
            out.append(f"{r}: one fragment's round trip takes {need[r]:.3g} s at {share[r].rate_gbit_s:.3g} Gbit/s"
                       f"{each}, more than tau x step x (1 - margin) = {usable_s:.3g} s at the largest tau allowed "
                       f"({c.tau}: plan.max_tau, and tau < H) at {setting}")
        if c.cu_by_region[r] < target_cu:
            sched = schedule_for(bandwidth_config(model.params, model.layers, step_time_s, c.sync_every,
                                                  c.fragments, c.tau, c.bits, share[r].rtt_s), METHOD)
            needed = min_rate_for_cu(sched, target_cu)
            how = ("no rate reaches it: the round-trip time alone stalls too long" if math.isinf(needed) else
                   f"reaching it needs {needed:.3g} Gbit/s{each}, {needed / share[r].rate_gbit_s:.1f}x the "
                   f"{share[r].rate_gbit_s:.3g} available")
            out.append(f"{r}: CU {c.cu_by_region[r]:.3f} < target {target_cu:g} at {setting}; {how}")
    return out
