"""A region's WAN link as measured or configured, one fragment's round trip over it and the τ it needs,
and when a measured link has moved enough to plan again (docs/planning.md, "Planning a run from its links")."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Iterable, Mapping, Sequence

from wan_diloco.config import ConfigError, require

REPLAN_THRESHOLD = 0.2  # re-plan when a link's rate moves by more than 20 %


@dataclasses.dataclass(frozen=True)
class LinkEstimate:
    """One region's WAN link to the syncer's region, as measured (or configured): each direction alike."""

    rate_gbit_s: float
    rtt_s: float

    def __post_init__(self) -> None:
        require(isinstance(self.rate_gbit_s, (int, float)) and math.isfinite(self.rate_gbit_s)
                and self.rate_gbit_s > 0, "rate_gbit_s", f"must be a finite number > 0, got {self.rate_gbit_s!r}")
        require(isinstance(self.rtt_s, (int, float)) and math.isfinite(self.rtt_s) and self.rtt_s >= 0,
                "rtt_s", f"must be a finite number >= 0, got {self.rtt_s!r}")

    def shared_by(self, learners: int) -> "LinkEstimate":
        """The share of one of ``learners`` learners: their fragments are due at the same step, so they
        split the rate; each still waits the whole round-trip time."""
        return LinkEstimate(self.rate_gbit_s / learners, self.rtt_s)


def round_trip_s(fragment_bytes: float, link: LinkEstimate, quorum_s: float = 0.0, sync_s: float = 0.0) -> float:
    """Seconds from a learner sending a fragment to the merged fragment being back with it.

    The runtime sends a fragment as one message up and the merged fragment as
    one message down, so both transfers count in full, each with its one-way
    delay (RTT/2 up + RTT/2 down = one RTT): ``2·bytes·8/rate + rtt + quorum + sync``.
    ``quorum_s`` is the wait for the K-th learner, ``sync_s`` the syncer's
    merge and outer step (transfers excluded).
    """
    transfer_s = fragment_bytes * 8 / (link.rate_gbit_s * 1e9)
    return 2 * transfer_s + link.rtt_s + quorum_s + sync_s


def tau_for_link(
    fragment_bytes: float,
    link: LinkEstimate,
    step_time_s: float,
    margin: float = 0.1,
    quorum_s: float = 0.0,
    sync_s: float = 0.0,
    max_tau: int | None = None,
) -> int | None:
    """Smallest τ >= 1 with ``round_trip_s(...) <= τ·step·(1 − margin)``; None if it needs more than ``max_tau``.

    The learner sends a fragment after step t and mixes the answer in after
    step t + τ, so τ whole steps are what the round trip may take; the margin
    keeps room for the rate to dip. The minimum is 1 even for a round trip of
    ~0 s: τ = 0 means the learner blocks for the answer, which Decoupled
    DiLoCo never does.
    """
    require(fragment_bytes >= 0, "fragment_bytes", f"must be >= 0, got {fragment_bytes}")
    require(step_time_s > 0, "step_time_s", f"must be > 0, got {step_time_s}")
    require(0 <= margin < 1, "margin", f"must be in [0, 1), got {margin}")
    require(quorum_s >= 0, "quorum_s", f"must be >= 0, got {quorum_s}")
    require(sync_s >= 0, "sync_s", f"must be >= 0, got {sync_s}")
    require(max_tau is None or max_tau >= 1, "max_tau", f"must be >= 1, got {max_tau}")
    need_s = round_trip_s(fragment_bytes, link, quorum_s, sync_s)
    usable_step_s = step_time_s * (1 - margin)
    # The 1e-9 keeps an exact fit (need = k·usable) from rounding up to k + 1.
    tau = max(1, math.ceil(need_s / usable_step_s - 1e-9))
    return None if max_tau is not None and tau > max_tau else tau


def replan_reasons(
    planned: Mapping[str, LinkEstimate], measured: Mapping[str, LinkEstimate], threshold: float = REPLAN_THRESHOLD
) -> list[str]:
    """One sentence per region whose measured rate moved by more than ``threshold`` of the planned rate.

    A region measured but not planned for is a reason too (its link was never
    checked); a planned region without a measurement is not (no news). An empty
    list means keep the plan.
    """
    require(threshold > 0, "threshold", f"must be > 0, got {threshold}")
    out = []
    for r, m in measured.items():
        p = planned.get(r)
        if p is None:
            out.append(f"{r}: rate {m.rate_gbit_s:.2f} Gbit/s measured on a link the plan does not cover")
            continue
        change = m.rate_gbit_s / p.rate_gbit_s - 1
        if abs(change) > threshold:
            out.append(f"{r}: rate {m.rate_gbit_s:.3g} Gbit/s measured vs {p.rate_gbit_s:.3g} planned "
                       f"({100 * change:+.0f} %)")
    return out


def confirmed_move(planned: LinkEstimate, recent: Sequence[LinkEstimate], threshold: float = REPLAN_THRESHOLD,
                   confirm: int = 2) -> LinkEstimate | None:
    """The link to re-plan for when the last ``confirm`` samples all moved the rate beyond ``threshold``
    of ``planned``, the same way; else None (one noisy probe, e.g. one that met the learner's own
    upload on the link, does not re-plan).

    Of the confirming samples it returns the one closest to ``planned``: the move every one of
    them shows, so one outlier does not overshoot.
    """
    require(confirm >= 1, "confirm", f"must be >= 1, got {confirm}")
    last = list(recent)[-confirm:]
    if len(last) < confirm:
        return None
    changes = [m.rate_gbit_s / planned.rate_gbit_s - 1 for m in last]
    if all(c > threshold for c in changes) or all(c < -threshold for c in changes):
        return min(zip(changes, last), key=lambda cm: abs(cm[0]))[1]
    return None


def links_from_metrics(lines: Iterable[str], source: str = "metrics") -> dict[str, LinkEstimate]:
    """The latest link measurement per region in a run's ``metrics.jsonl`` lines.

    Link events look like ``{"source": "learner-1", "event": "link", "region":
    "eu-west", "rtt_ms": 61.2, "rate_gbit_s": 1.87, ...}``; other events are
    skipped, later lines win. A line that is not JSON is an error naming it,
    except the last one, which a live run may still be writing.
    """
    lines = list(lines)
    out: dict[str, LinkEstimate] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                break
            raise ConfigError(f"{source} line {i}: not JSON: {line.strip()[:60]!r}") from None
        if not isinstance(event, dict) or event.get("event") != "link":
            continue
        where = f"{source} line {i}"
        region = event.get("region")
        require(isinstance(region, str) and bool(region), f"{where}: region", f"must be a region name, got {region!r}")
        for key in ("rate_gbit_s", "rtt_ms"):
            v = event.get(key)
            require(isinstance(v, (int, float)) and not isinstance(v, bool), f"{where}: {key}",
                    f"must be a number, got {v!r}")
        try:
            out[region] = LinkEstimate(float(event["rate_gbit_s"]), float(event["rtt_ms"]) / 1e3)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out
