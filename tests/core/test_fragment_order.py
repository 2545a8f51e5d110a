"""learner.fragment_order: a learner core sends its fragments in the planned slot order (fragments.Schedule)."""
import numpy as np
import pytest

from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import LearnerConfig, LearnerCore, Snapshot
from wan_diloco.fragments import Layout
from wan_diloco.planning.plan import fragment_order

FRAGS = [(f"block_{p}/w",) for p in range(4)]
PARAMS = {f: np.full(3, p, np.float32) for p, (f,) in enumerate(FRAGS)}
CODEC = FragmentCodec(CodecConfig(bits=32), Layout(FRAGS, {n: a.shape for n, a in PARAMS.items()}))


def sends(**kw) -> list[tuple[int, int]]:
    """(step, fragment) of every fragment the core sends in 20 steps (two rounds of H = 10)."""
    lc = LearnerCore(LearnerConfig(sync_every=10, num_fragments=4, tau=1, **kw), 0, FRAGS, PARAMS, CODEC)
    out = []
    for t in range(20):
        lc.begin_step(float(t))
        out += [(lc.step, a.fragment) for a in lc.step_done(t + 1.0, 100) if isinstance(a, Snapshot)]
    return out


def test_default_order_is_index_order():
    # Slots at ⌊k·10/4⌋ = 0, 2, 5, 7 send fragments 0..3; slot 0 is the end of each round (step 10, 20).
    expected = [(2, 1), (5, 2), (7, 3), (10, 0), (12, 1), (15, 2), (17, 3), (20, 0)]
    assert sends() == expected
    assert sends(fragment_order=(0, 1, 2, 3)) == expected


def test_a_planned_order_is_the_order_the_learner_syncs_in():
    # Unequal fragments: the planner gives the largest the slots followed by the longest gaps (3 steps).
    order = fragment_order([1.0, 3.0, 2.0, 2.0], sync_every=10)
    assert order == (2, 1, 0, 3)
    got = sends(fragment_order=order)
    assert got == [(2, 1), (5, 0), (7, 3), (10, 2), (12, 1), (15, 0), (17, 3), (20, 2)]
    # Every fragment still syncs once per round, H steps apart.
    for p in range(4):
        steps = [s for s, q in got if q == p]
        assert len(steps) == 2 and steps[1] - steps[0] == 10


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 1, 1, 3), (0, 1, 2, 4)])
def test_a_bad_order_is_refused_naming_the_field(order):
    with pytest.raises(ValueError, match="fragment_order"):
        LearnerConfig(sync_every=10, num_fragments=4, tau=1, fragment_order=order).validate()
