import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wan_diloco.planning import intervals as iv


def test_absorbing_pauses_ignore_events_inside_a_pause():
    s, e = iv.absorbing_pauses(np.array([0.0, 1.0, 5.0, 6.0, 20.0]), np.array([5.0, 100.0, 3.0, 1.0, 1.0]))
    # The event at 1 falls inside [0, 5) and is absorbed; 5 starts a new pause; 6 is inside it.
    assert s.tolist() == [0.0, 5.0, 20.0] and e.tolist() == [5.0, 8.0, 21.0]


def test_union_merges_overlaps():
    s, e = iv.union(np.array([5.0, 0.0, 2.0, 9.0]), np.array([6.0, 3.0, 4.0, 10.0]))
    assert s.tolist() == [0.0, 5.0, 9.0] and e.tolist() == [4.0, 6.0, 10.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0.01, 20)), min_size=0, max_size=20),
       st.lists(st.floats(0, 80), min_size=1, max_size=5))
def test_step_function_integral_matches_a_fine_grid(ups, xs):
    up = np.array([u for u, _ in ups])
    down = np.array([u + d for u, d in ups])
    f = iv.StepFunction(up, down)
    grid = np.linspace(0, 80, 80001)
    values = ((up[None, :] <= grid[:, None]) & (grid[:, None] < down[None, :])).sum(1) if len(up) else np.zeros_like(grid)
    for x in xs:
        brute = values[grid < x].sum() * (grid[1] - grid[0])
        assert abs(f.integral_to(np.array([x]))[0] - brute) < 0.02 * (len(up) + 1)


def test_intervals_at_least():
    f = iv.StepFunction(np.array([1.0, 2.0, 8.0]), np.array([4.0, 3.0, 9.0]))
    s, e = f.intervals_at_least(2, 100.0)
    assert s.tolist() == [2.0] and e.tolist() == [3.0]
    s, e = f.intervals_at_least(1, 8.5)
    assert s.tolist() == [1.0, 8.0] and e.tolist() == [4.0, 8.5]
