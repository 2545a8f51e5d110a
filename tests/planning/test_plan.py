import json
import math

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.bandwidth import BandwidthConfig, schedule_for
from wan_diloco.planning.plan import (
    LinkEstimate,
    ModelFacts,
    confirmed_move,
    fragment_order,
    links_from_metrics,
    plan_run,
    replan_reasons,
    round_trip_s,
    tau_for_link,
)
from wan_diloco.planning.timeline import compute_utilization, min_rate_for_cu


def _cu(params, layers, step, plan, link: LinkEstimate) -> float:
    """The CU `wan-diloco bandwidth --method decoupled` reports for the plan's settings on `link`."""
    cfg = BandwidthConfig(params=params, layers=layers, step_time_s=step, sync_every=plan.sync_every,
                          fragments=plan.fragments, tau=plan.tau, bits=plan.bits, rtt_s=link.rtt_s)
    return compute_utilization(schedule_for(cfg, "decoupled"), link.rate_gbit_s)


# ---- tau_for_link ------------------------------------------------------------------------


def test_round_trip_counts_both_transfers_and_one_rtt():
    # 125 MB = 1 Gbit: 0.1 s each way on 10 Gbit/s, plus 50 ms RTT, 20 ms quorum, 10 ms merge.
    assert round_trip_s(125e6, LinkEstimate(10.0, 0.05), quorum_s=0.02, sync_s=0.01) == pytest.approx(0.28)


@pytest.mark.parametrize(
    "kwargs, tau",
    [({}, 3),                                   # 0.25 s / (0.1 s x 0.9) = 2.78 -> 3
     ({"quorum_s": 0.02}, 3),                   # 0.27 / 0.09 = 3 exactly: an exact fit is not rounded up
     ({"quorum_s": 0.02, "sync_s": 0.01}, 4),   # 0.28 / 0.09 = 3.11 -> 4
     ({"margin": 0.0}, 3),                      # 0.25 / 0.1 = 2.5 -> 3
     ({"margin": 0.5}, 5),                      # 0.25 / 0.05 = 5
     ({"quorum_s": 0.02, "sync_s": 0.01, "max_tau": 3}, None),
     ({"max_tau": 3}, 3)],
)
def test_tau_for_link_by_hand(kwargs, tau):
    assert tau_for_link(125e6, LinkEstimate(10.0, 0.05), 0.1, **kwargs) == tau


def test_tau_is_at_least_one_even_for_an_instant_round_trip():
    assert tau_for_link(0.0, LinkEstimate(100.0, 0.0), 1.0) == 1


# ---- plan_run -----------------------------------------------------------------------------


def test_plan_uses_the_bandwidth_model_and_picks_the_hand_derived_setting():
    # 1B params, 24 layers, 0.1 s steps, one learner on 2.5 Gbit/s with 60 ms RTT, margin 0.1:
    # H=10: 4-bit demand 1e9*4/(10*0.1) = 4 Gbit/s > 2.25. H=25: 8-bit demand 3.2 > 2.25; 4-bit 1.6 fits.
    # At H=25, 4 bits, τ may be anything below H (the run's rule, fragments.tau_bounds) up to max_tau 5:
    # P=24: 20.8 MB each, 0.0667 s each way: 0.193 s / 0.09 -> tau 3; P=12: 2*0.133 s + 0.06 = 0.327 s -> 4.
    # The smallest τ wins: H=25, P=24, τ=3 (τ >= H/P: several fragments in flight, as the paper's P=H=24).
    link = LinkEstimate(2.5, 0.06)
    plan = plan_run(ModelFacts(10**9, 24), {"eu-west": link}, 0.1, {"eu-west": 1})
    assert plan.reached and plan.why == ()
    assert (plan.sync_every, plan.fragments, plan.tau, plan.bits) == (25, 24, 3, 4)
    assert plan.tau_by_region == {"eu-west": 3}
    assert plan.fragment_bytes == pytest.approx(1e9 / 24 / 2)
    assert plan.demand_gbit_s_by_region["eu-west"] == pytest.approx(1.6)
    # Grace: 0.8 x (3 x 0.1 x 0.9 - 0.1933) = 0.0613 s.
    assert plan.max_grace_s == pytest.approx(0.8 * (0.27 - (2 * 20.8333e6 * 8 / 2.5e9 + 0.06)), rel=1e-4)
    assert plan.cu_predicted == _cu(1e9, 24, 0.1, plan, link)
    assert plan.cu_predicted >= 0.95
    assert plan.fragment_order == tuple(range(24))  # equal sizes: index order
    json.dumps(plan.to_dict())


def test_every_region_stays_under_its_rate_and_a_slow_region_gets_a_larger_tau():
    links = {"fast": LinkEstimate(4.0, 0.03), "slow": LinkEstimate(0.5, 0.15)}
    plan = plan_run(ModelFacts(10**8, 12), links, 0.2, {"fast": 2, "slow": 1, "hub": 3}, margin=0.1)
    assert plan.reached
    assert (plan.sync_every, plan.fragments, plan.tau, plan.bits) == (10, 12, 2, 4)
    # slow: 4.17 MB -> 0.0667 s each way + 0.15 s = 0.283 s over 0.18 s steps -> 2; fast (2 Gbit/s each): 1.
    assert plan.tau_by_region == {"fast": 1, "slow": 2}
    assert plan.tau == max(plan.tau_by_region.values())
    for region, n in {"fast": 2, "slow": 1}.items():
        demand = n * 1e8 * plan.bits / (plan.sync_every * 0.2) / 1e9
        assert plan.demand_gbit_s_by_region[region] == pytest.approx(demand)
        assert demand <= links[region].rate_gbit_s * 0.9
    assert set(plan.links) == {"fast", "slow"} and any("hub" in n for n in plan.notes)
    # Two learners share the fast link: each is modelled at half its rate. Bottleneck: the lowest CU.
    per_learner = {"fast": LinkEstimate(2.0, 0.03), "slow": links["slow"]}
    cus = {r: _cu(1e8, 12, 0.2, plan, per_learner[r]) for r in per_learner}
    assert plan.cu_by_region == cus
    assert plan.cu_predicted == min(cus.values()) == cus[plan.bottleneck]
    assert plan.max_grace_s == pytest.approx(0.8 * (2 * 0.18 - (2 * 1e8 / 12 / 2 * 8 / 0.5e9 + 0.15)))


def test_learners_sharing_a_link_plan_like_one_learner_on_their_share():
    facts = ModelFacts(3 * 10**8, 12)
    shared = plan_run(facts, {"r": LinkEstimate(2.0, 0.08)}, 0.15, {"r": 4})
    alone = plan_run(facts, {"r": LinkEstimate(0.5, 0.08)}, 0.15, {"r": 1})
    for field in ("sync_every", "fragments", "tau", "bits", "cu_predicted", "max_grace_s"):
        assert getattr(shared, field) == getattr(alone, field), field
    assert shared.demand_gbit_s_by_region["r"] == pytest.approx(4 * alone.demand_gbit_s_by_region["r"])


def test_unreachable_target_says_which_link_and_by_how_much():
    link = LinkEstimate(0.1, 0.06)
    plan = plan_run(ModelFacts(10**10, 48), {"eu-west": link}, 0.8, {"eu-west": 1})
    assert not plan.reached and plan.cu_predicted < 0.95
    assert plan.cu_predicted == _cu(1e10, 48, 0.8, plan, link)
    assert plan.why and all(w.startswith("eu-west:") for w in plan.why)
    cfg = BandwidthConfig(params=1e10, layers=48, step_time_s=0.8, sync_every=plan.sync_every,
                          fragments=plan.fragments, tau=plan.tau, bits=plan.bits, rtt_s=0.06)
    needed = min_rate_for_cu(schedule_for(cfg, "decoupled"), 0.95)
    assert any(f"needs {needed:.3g} Gbit/s" in w and f"{needed / 0.1:.1f}x" in w for w in plan.why)
    assert any("round trip" in w for w in plan.why)  # a 1.25 GB fragment takes 100 s each way
    assert plan.tau_by_region == {"eu-west": None}


def test_fragment_sizes_set_tau_and_order():
    # Given sizes at P=2 (the largest, 3/4 of the model, sets the round trip) vs equal layers.
    facts = ModelFacts(4 * 10**8, 4, fragment_params=(10**8, 3 * 10**8))
    plan = plan_run(facts, {"r": LinkEstimate(1.0, 0.0)}, 1.0, {"r": 1}, fragment_options=[2],
                    sync_every_options=[24], bits_options=[8], max_tau=10)
    assert plan.reached
    assert plan.fragment_params == (1e8, 3e8) and plan.fragment_bytes == 3e8
    assert plan.tau == 6  # 2 x 2.4 s / 0.9 s = 5.33 -> 6 (equal halves would give 2 x 1.6 / 0.9 -> 4)
    assert plan.fragment_order == (1, 0)  # equal gaps (offsets 0 and 12 of 24): the largest goes first
    # Sizes given for another P do not apply: P=4 is cut as equal layers.
    other = plan_run(facts, {"r": LinkEstimate(1.0, 0.0)}, 1.0, {"r": 1}, fragment_options=[4],
                     sync_every_options=[24], bits_options=[8], max_tau=10)
    assert other.fragment_params == (1e8,) * 4 and any("P=4" in n for n in other.notes)


@pytest.mark.parametrize(
    "sizes, h, order",
    [([1, 1, 1, 1], 10, (0, 1, 2, 3)),  # equal sizes keep index order whatever the gaps
     ([1, 2, 3, 4], 10, (1, 3, 0, 2)),  # offsets 0 2 5 7: gaps 2 3 2 3, largest into the long gaps
     ([1, 2, 3, 4], 8, (3, 2, 1, 0)),   # equal gaps: largest first
     ([5, 5, 3, 3], 10, (2, 0, 3, 1))],
)
def test_fragment_order(sizes, h, order):
    assert fragment_order(sizes, h) == order


# ---- replanning and measured links ----------------------------------------------------------


@pytest.mark.parametrize("factor, n", [(1.19, 0), (0.81, 0), (1.21, 1), (0.79, 1), (1.0, 0)])
def test_replan_threshold(factor, n):
    planned = {"eu-west": LinkEstimate(2.0, 0.06), "ap-south": LinkEstimate(1.0, 0.2)}
    measured = {"eu-west": LinkEstimate(2.0 * factor, 0.5), "ap-south": LinkEstimate(1.0, 0.2)}
    reasons = replan_reasons(planned, measured)
    assert len(reasons) == n
    if n:
        assert reasons[0].startswith("eu-west: rate ") and f"{100 * (factor - 1):+.0f} %" in reasons[0]


def test_replan_reason_wording_and_new_regions():
    planned = {"eu-west": LinkEstimate(2.0, 0.06)}
    assert replan_reasons(planned, {"eu-west": LinkEstimate(0.21, 0.06)}) == [
        "eu-west: rate 0.21 Gbit/s measured vs 2 planned (-90 %)"]
    assert replan_reasons(planned, {}) == []
    assert replan_reasons(planned, {"ap-south": LinkEstimate(1.0, 0.2)})[0].startswith("ap-south:")


def test_a_move_must_show_in_consecutive_probes_and_the_smaller_move_is_taken():
    planned, L = LinkEstimate(2.0, 0.06), (lambda rate: LinkEstimate(rate, 0.06))
    assert confirmed_move(planned, [L(0.5)]) is None  # one low probe (it met our own upload): no re-plan
    assert confirmed_move(planned, [L(0.5), L(1.9)]) is None  # the next one disagrees
    assert confirmed_move(planned, [L(2.6), L(0.5)]) is None  # opposite ways
    assert confirmed_move(planned, [L(2.0), L(0.2), L(0.4)]) == L(0.4)  # both low: the smaller drop
    assert confirmed_move(planned, [L(2.9), L(2.5)]) == L(2.5)
    assert confirmed_move(planned, [L(0.2)], confirm=1) == L(0.2)
    with pytest.raises(ConfigError, match="^confirm:"):
        confirmed_move(planned, [L(0.2)], confirm=0)


def _event(region, rate, rtt_ms, learner=1):
    return json.dumps({"source": f"learner-{learner}", "event": "link", "role": "learner", "learner": learner,
                       "region": region, "step": 3, "rtt_ms": rtt_ms, "rate_gbit_s": rate,
                       "probe_bytes": 1000, "probe_s": 0.01}) + "\n"


def test_links_from_metrics_takes_the_latest_per_region():
    lines = [json.dumps({"source": "syncer", "event": "listening", "port": 1}) + "\n",
             _event("eu-west", 1.5, 61.0), _event("ap-south", 0.4, 180.0, learner=2),
             _event("eu-west", 1.25, 70.0, learner=3), '{"source": "learner-1", "ev']  # last line still being written
    links = links_from_metrics(lines)
    assert links == {"eu-west": LinkEstimate(1.25, 0.07), "ap-south": LinkEstimate(0.4, 0.18)}


@pytest.mark.parametrize(
    "lines, field",
    [(["not json\n", _event("eu-west", 1.0, 60)], "m.jsonl line 1"),
     ([_event("eu-west", 0.0, 60)], "m.jsonl line 1: rate_gbit_s"),
     ([_event("eu-west", 1.0, -1)], "m.jsonl line 1: rtt_s"),
     (['{"event": "link", "region": "eu-west", "rtt_ms": 3}\n'], "m.jsonl line 1: rate_gbit_s"),
     (['{"event": "link", "rtt_ms": 3, "rate_gbit_s": 1}\n'], "m.jsonl line 1: region")],
)
def test_links_from_metrics_errors_name_the_line(lines, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        links_from_metrics(lines, source="m.jsonl")


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, field",
    [(lambda: LinkEstimate(0.0, 0.05), "rate_gbit_s"),
     (lambda: LinkEstimate(math.inf, 0.05), "rate_gbit_s"),
     (lambda: LinkEstimate(1.0, -0.01), "rtt_s"),
     (lambda: ModelFacts(0, 4), "params"),
     (lambda: ModelFacts(100, 0), "layers"),
     (lambda: ModelFacts(100, 4, fragment_params=(30, 30)), "fragment_params"),
     (lambda: tau_for_link(1e6, LinkEstimate(1.0, 0.0), 0.0), "step_time_s"),
     (lambda: tau_for_link(1e6, LinkEstimate(1.0, 0.0), 0.1, margin=1.0), "margin"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, 0.1, {"r": 1}, target_cu=1.5),
      "target_cu"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, -1.0, {"r": 1}), "step_time_s"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, 0.1, {"r": 1}, margin=-0.1), "margin"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, 0.1, {"r": 1}, bits_options=(3,)),
      "bits_options"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, 0.1, {"hub": 2}), "links"),
     (lambda: plan_run(ModelFacts(10**6, 4), {"r": LinkEstimate(1.0, 0.0)}, 0.1, {"r": -1}),
      "learners_per_region.r"),
     (lambda: replan_reasons({}, {}, threshold=0.0), "threshold")],
)
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make()
