import re

import pytest

from wan_diloco import fragments as F


def layer_of(name):
    m = re.match(r"block_(\d+)/", name)
    return int(m.group(1)) if m else None


def toy_sizes(n_layers=2, d=64):
    sizes = {"embed/embedding": 256 * d}
    for i in range(n_layers):
        sizes[f"block_{i}/attn/qkv/kernel"] = d * 3 * d
        sizes[f"block_{i}/attn/out/kernel"] = d * d
        sizes[f"block_{i}/mlp/up/kernel"] = d * 4 * d
        sizes[f"block_{i}/mlp/down/kernel"] = 4 * d * d
        sizes[f"block_{i}/norm/scale"] = d
    sizes["final_norm/scale"] = d
    sizes["lm_head/kernel"] = d * 256
    return sizes


@pytest.mark.parametrize("strategy", F.STRATEGIES)
@pytest.mark.parametrize("p", [1, 2, 3, 8])
def test_every_tensor_in_exactly_one_fragment(strategy, p):
    sizes = toy_sizes(4)
    frags = F.make_fragments(strategy, sizes, p, layer_of)
    assert len(frags) == p
    F.check_cover(frags, list(sizes))


def test_balanced_lowest_peak_and_no_empty_slots_when_layers_fewer_than_slots():
    sizes = toy_sizes(n_layers=2)
    h, p = 8, 8  # 8 sync slots, only 2 layers
    stats = {s: F.bytes_per_step(F.make_fragments(s, sizes, p, layer_of), sizes, h) for s in F.STRATEGIES}
    assert stats["balanced"].empty_slots == 0
    assert stats["layer"].empty_slots == p - 2  # bursty: only two slots send anything
    assert stats["balanced"].peak_bytes < stats["layer"].peak_bytes
    assert stats["balanced"].peak_bytes < stats["tensor"].peak_bytes
    # same total traffic whatever the strategy
    assert len({round(s.mean_bytes) for s in stats.values()}) == 1


def test_balanced_sizes_nearly_equal():
    sizes = toy_sizes(n_layers=8)
    frags = F.balanced_fragments(sizes, 4)
    totals = [sum(sizes[n] for n in f) for f in frags]
    assert max(totals) - min(totals) <= max(sizes.values())


def test_schedule_spreads_fragments_evenly():
    s = F.Schedule(sync_every=8, num_fragments=4)
    assert [s.offset(p) for p in range(4)] == [0, 2, 4, 6]
    due = [p for t in range(1, 17) for p in s.due(t)]
    assert sorted(due) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert s.due(0) == []
    assert s.due(8) == [0] and s.due(2) == [1]
    assert s.due_between(0, 4) == [(2, 1), (4, 2)]


def test_more_fragments_than_steps():
    s = F.Schedule(sync_every=2, num_fragments=4)
    assert sorted(p for t in range(1, 3) for p in s.due(t)) == [0, 1, 2, 3]


@pytest.mark.parametrize("h, p", [(0, 1), (4, 0)])
def test_bad_schedule(h, p):
    with pytest.raises(ValueError, match="schedule"):
        F.Schedule(h, p)


def test_bad_strategy_and_no_blocks():
    with pytest.raises(ValueError, match="unknown strategy"):
        F.make_fragments("nope", toy_sizes(), 2, layer_of)
    with pytest.raises(ValueError, match="no transformer blocks"):
        F.make_fragments("layer", {"a": 3}, 2, layer_of)


def test_schedule_order_maps_slots_to_fragments():
    s = F.Schedule(sync_every=8, num_fragments=4, order=(2, 0, 3, 1))
    assert [s.offset(p) for p in range(4)] == [2, 6, 0, 4]  # fragment order[k] at slot k's ⌊k·H/P⌋
    assert s.due(8) == [2] and s.due(2) == [0]
    assert F.Schedule(8, 4).order == F.Schedule(8, 4, (0, 1, 2, 3)).order == (0, 1, 2, 3)
    # The 0-based step index within a round after which fragment p goes (the bandwidth timeline's count).
    assert [F.Schedule(8, 4).round_index(p) for p in range(4)] == [7, 1, 3, 5]


@pytest.mark.parametrize("order, match", [((0, 1), "each of the 4"), ((0, 1, 1, 2), "listed 2 times"),
                                          ((0, 1, 2, 7), "indices 0..3"), ((0, 1, 2, True), "indices 0..3")])
def test_bad_order_names_the_field(order, match):
    with pytest.raises(ValueError, match=f"fragment_order: .*{match}"):
        F.Schedule(8, 4, order)


def test_tau_bounds_is_the_one_rule():
    # τ < H whatever P (τ >= H/P is allowed: several fragments in flight, as the paper's P = H = 24, τ = 2).
    assert F.tau_bounds(24, 24) == (0, 23)
    assert F.tau_bounds(8, 4) == F.Schedule(8, 4).tau_bounds() == (0, 7)
    assert F.tau_bounds(8, 4, max_tau=5) == (0, 5) and F.tau_bounds(4, 2, max_tau=5) == (0, 3)
    with pytest.raises(ValueError, match="schedule"):
        F.tau_bounds(0, 4)
