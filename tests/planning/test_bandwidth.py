import json
import math
from pathlib import Path

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.planning.bandwidth import (
    METHODS,
    PAPER_METHODS,
    BandwidthConfig,
    cu_at_rate,
    fragment_layers,
    parse_methods,
    required_rates,
    schedule_for,
    step_time_from_flops,
)
from wan_diloco.planning.timeline import compute_utilization, min_rate_for_cu

REFERENCE = json.loads((Path(__file__).parent / "reference" / "streaming_diloco_bandwidth.json").read_text())
ONE_B = BandwidthConfig(params=1e9, layers=24, step_time_s=0.1)


@pytest.mark.parametrize("row", REFERENCE["rows"], ids=lambda r: r["model"])
def test_every_reference_cell_within_factor_1_5(row):
    cfg = BandwidthConfig(params=row["params"], layers=row["layers"], step_time_s=row["step_time_s"])
    got = required_rates(cfg, PAPER_METHODS, tuple(REFERENCE["cu_targets"]))
    for method in PAPER_METHODS:
        for target, mine, paper in zip(REFERENCE["cu_targets"], got[method], row[method]):
            ratio = mine / paper
            assert 1 / 1.5 <= ratio <= 1.5, f"{row['model']} {method} CU {target}: {mine:.2f} vs paper {paper}"


def test_diloco_stall_matches_closed_form():
    # Slow link: the FIFO is busy from the first ready gradient (after the forward
    # pass and one layer's backward) until the last byte, so the stall per sync is
    # V/r - (2L - 2) * node, node = step / (3L).
    cfg = BandwidthConfig(params=1e9, layers=24, step_time_s=0.1, sync_every=50, bits=16)
    rate = 2.0
    v_s = 1e9 * 16 / (rate * 1e9)
    node = 0.1 / 72
    stall = v_s - (2 * 24 - 2) * node
    expected = 50 * 0.1 / (50 * 0.1 + stall)
    assert compute_utilization(schedule_for(cfg, "diloco"), rate) == pytest.approx(expected, rel=1e-9)


def test_ring_volume_scales_with_datacenters():
    # With no RTT only bits/rate matters; a 4-site ring sends 1.5x what a 2-site one does.
    two = schedule_for(ONE_B, "data_parallel")
    four = schedule_for(BandwidthConfig(params=1e9, layers=24, step_time_s=0.1, datacenters=4), "data_parallel")
    for rate in (50.0, 200.0, 800.0):
        assert compute_utilization(four, rate * 1.5) == pytest.approx(compute_utilization(two, rate), rel=1e-9)


def test_cu_never_decreases_with_rate():
    for method in METHODS:
        sched = schedule_for(ONE_B, method)
        cus = [compute_utilization(sched, 0.05 * 1.3**i) for i in range(60)]
        assert all(b >= a - 1e-12 for a, b in zip(cus, cus[1:])), method
        assert cus[0] < 0.2 and cus[-1] > 0.999


def test_search_returns_the_smallest_rate():
    sched = schedule_for(ONE_B, "streaming")
    rate = min_rate_for_cu(sched, 0.9)
    assert compute_utilization(sched, rate) >= 0.9
    assert compute_utilization(sched, rate / 1.01) < 0.9


def test_four_bit_needs_a_quarter_and_methods_are_ordered():
    rates = required_rates(ONE_B, METHODS, (0.8, 0.95))
    for i in range(2):
        assert rates["streaming_overlap"][i] / rates["streaming_overlap_4bit"][i] == pytest.approx(4, rel=0.02)
        order = [rates[m][i] for m in ("streaming_overlap", "streaming", "diloco", "data_parallel")]
        assert order == sorted(order)
        # The hub round trip (upload, merge, download) costs decoupled more than a ring.
        assert rates["decoupled"][i] > rates["streaming_overlap"][i]


def test_rtt_can_make_a_target_unreachable():
    slow = BandwidthConfig(params=1e9, layers=24, step_time_s=0.1, rtt_s=0.05)
    assert math.isinf(min_rate_for_cu(schedule_for(slow, "data_parallel"), 0.99))
    # Overlap hides the same RTT.
    assert math.isfinite(min_rate_for_cu(schedule_for(slow, "streaming_overlap"), 0.99))


def test_more_overlap_needs_less_bandwidth():
    need = [required_rates(BandwidthConfig(params=1e9, layers=24, step_time_s=0.1, tau=t), ("streaming_overlap",), (0.95,))
            ["streaming_overlap"][0] for t in (0, 1, 3)]
    assert need[0] > need[1] > need[2]


def test_cu_at_rate_reports_every_method():
    cu = cu_at_rate(ONE_B, METHODS, 10.0)
    assert set(cu) == set(METHODS) and all(0 < v <= 1 for v in cu.values())
    assert cu["data_parallel"] < 0.2 < cu["diloco"] < cu["streaming_overlap_4bit"]


def test_fragment_layers_partition_consecutively():
    frags = fragment_layers(25, 8)
    assert [x for f in frags for x in f] == list(range(25))
    assert {len(f) for f in frags} == {3, 4}


def test_step_time_from_flops():
    assert step_time_from_flops(1e9, 1e6, 0.5, 1e4) == pytest.approx(6e15 / 5e15)


def test_parse_methods():
    assert parse_methods("all") == PAPER_METHODS + ("decoupled",)  # the toolkit's own method is in the default
    assert parse_methods("paper") == PAPER_METHODS
    assert parse_methods("decoupled, diloco,decoupled") == ("decoupled", "diloco")
    with pytest.raises(ConfigError, match="method: unknown method 'ring'"):
        parse_methods("all,ring")


@pytest.mark.parametrize(
    "changes, field",
    [({"layers": 0}, "layers"), ({"fragments": 30}, "fragments"), ({"tau": 100}, "tau"),
     ({"bits": 3}, "bits"), ({"datacenters": 1}, "datacenters"), ({"rtt_s": -1.0}, "rtt_s")],
)
def test_bad_config_names_the_field(changes, field):
    cfg = BandwidthConfig(**{"params": 1e9, "layers": 24, "step_time_s": 0.1, **changes})
    with pytest.raises(ConfigError, match=f"^{field}:"):
        cfg.validate()


def test_via_hub_moves_each_sites_bytes_up_and_down_whatever_the_site_count():
    from wan_diloco.planning.bandwidth import BandwidthConfig, schedule_for
    from wan_diloco.planning.timeline import compute_utilization

    def cu(method, dcs, hub):
        c = BandwidthConfig(params=1e9, layers=8, step_time_s=1.0, datacenters=dcs, grad_bits=16, tau=1)
        return compute_utilization(schedule_for(c, method, via_hub=hub), 16.0)

    # 16 Gbit of gradients on a 16 Gbit/s link: through a hub they cross it twice, a 2-site ring once
    assert cu("data_parallel", 2, True) < cu("data_parallel", 2, False)
    assert cu("data_parallel", 2, True) == cu("data_parallel", 8, True)  # a ring of 8 sends 1.75x, a hub 1x
    assert cu("data_parallel", 8, False) < cu("data_parallel", 8, True)
    assert cu("decoupled", 4, True) == cu("decoupled", 4, False)  # the syncer is a hub already


def test_fragments_go_on_the_wire_when_the_run_sends_them():
    # The run's rule (fragments.Schedule): fragment p after step offset(p) of each round, fragment 0 last.
    from wan_diloco.fragments import Schedule
    cfg = BandwidthConfig(params=1e9, layers=8, step_time_s=0.1, sync_every=8, fragments=4, tau=1)
    timeline = schedule_for(cfg, "decoupled")
    sent = {i: [s.layers for s in syncs] for i, syncs in timeline.syncs.items()}
    assert sent == {1: [(2, 3)], 3: [(4, 5)], 5: [(6, 7)], 7: [(0, 1)]}
    assert all(sent[Schedule(8, 4).round_index(p)] == [(2 * p, 2 * p + 1)] for p in range(4))
