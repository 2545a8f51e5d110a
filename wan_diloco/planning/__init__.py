"""Planning tools: bandwidth needed per compute-utilization target, a run's plan from its links, goodput under
failures, failure tapes."""
from wan_diloco.planning.bandwidth import (
    METHODS,
    PAPER_METHODS,
    BandwidthConfig,
    cu_at_rate,
    required_rates,
    schedule_for,
)
from wan_diloco.planning.goodput import GoodputConfig, GoodputResult, simulate
from wan_diloco.planning.plan import (
    LinkEstimate,
    ModelFacts,
    Plan,
    confirmed_move,
    fragment_order,
    links_from_metrics,
    plan_run,
    replan_reasons,
    round_trip_s,
    tau_for_link,
)
from wan_diloco.planning.recommend import Recommendation, recommend
from wan_diloco.tape import Outage, load_tape, save_tape, scale_tape
from wan_diloco.planning.timeline import compute_utilization, min_rate_for_cu

__all__ = [
    "METHODS", "PAPER_METHODS", "BandwidthConfig", "cu_at_rate", "required_rates", "schedule_for",
    "GoodputConfig", "GoodputResult", "simulate", "Recommendation", "recommend",
    "LinkEstimate", "ModelFacts", "Plan", "confirmed_move", "fragment_order", "links_from_metrics", "plan_run", "replan_reasons",
    "round_trip_s", "tau_for_link",
    "Outage", "load_tape", "save_tape", "scale_tape", "compute_utilization", "min_rate_for_cu",
]
