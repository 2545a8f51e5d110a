"""The one schedule in the cores: learner.fragment_order (the planned slot order) and the one τ bound."""
import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.config import ConfigError
from wan_diloco.core import LearnerConfig, LearnerCore, Metadata, ProtocolError, Snapshot, SyncerConfig, SyncerCore
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


def test_both_cores_bound_tau_by_the_same_rule():
    # τ <= H - 1 (fragments.tau_bounds), whatever P: τ = H/P and above are fine, τ = H is not.
    LearnerConfig(sync_every=8, num_fragments=4, tau=7).validate()
    with pytest.raises(ConfigError, match=r"tau: must be in \[0, 7\]"):
        LearnerConfig(sync_every=8, num_fragments=4, tau=8).validate()
    s = SyncerCore(SyncerConfig(num_learners=2, sync_every=8), FRAGS, PARAMS, lambda n: False, CODEC)
    s.on_metadata(0.0, _meta(0, tau=7))
    with pytest.raises(ProtocolError, match=r"tau must be in \[0, 7\] \(below H = 8\), got 8"):
        s.on_metadata(0.0, _meta(1, tau=8))
    assert s.learners[0].tau == 7 and 1 not in s.learners


def _meta(learner: int, tau: int) -> Metadata:
    return Metadata(learner=learner, step=1, c_steps=(1,) * 4, c_tokens=(100,) * 4,
                    clock=VectorClock({f"learner-{learner}": 1}), step_s=1.0, tau=tau)
