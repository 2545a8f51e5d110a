"""#23 case 1 as a real run saw it, at core speed: a token holder reports step = run.steps for learner 1 early
in a 2-learner run. The syncer refuses that one report and nothing else: the global step (what every learner
adopts from its updates) stays where the honest learners are, both go on to the budget unrefused, and the
final sync starts there and not before. The real-process run of the same story is
tests/runtime/test_syncer_refusals.py::test_one_metadata_at_the_last_step_does_not_end_a_real_run (slow);
the refusal over the wire, on /metrics and /status is the default run's test in that file."""
import dataclasses

import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata, ProtocolError, SyncerConfig, SyncerCore

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload

STEPS, H, STEP_S = 300, 8, 0.02  # the real test's run.steps, learner.sync_every and run.min_step_s


def md(learner, step):
    return Metadata(learner=learner, step=step, c_steps=(1, 1), c_tokens=(128, 128),
                    clock=VectorClock({f"learner-{learner}": step}), step_s=STEP_S)


def test_one_report_of_the_last_step_is_refused_and_both_learners_train_to_the_budget():
    # As Assembly.syncer_core(bounded=True) configures a networked run of STEPS steps.
    cfg = SyncerConfig(num_learners=2, quorum=1, grace=False, max_step=STEPS + H, final_min_step=STEPS)
    s = SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC)
    t = 0.0
    for step in range(1, 21):
        t += STEP_S
        for m in (0, 1):
            s.on_metadata(t, md(m, step))
    with pytest.raises(ProtocolError, match="past what its pace allows") as e:
        s.on_metadata(t + 0.001, Metadata(learner=1, step=STEPS, c_steps=(0, 0), c_tokens=(0, 0),
                                          clock=VectorClock({"learner-1": 1})))
    assert e.value.field == "metadata.step"
    assert s.global_step == 20 < STEPS // 2 and s.refusals.by_field == {"metadata.step": 1}
    for step in range(21, STEPS + 1):  # both go on, every step their own; nobody is refused again
        t += STEP_S
        for m in (0, 1):
            s.on_metadata(t, md(m, step))
        assert s.global_step == step
        if step % H == 0:  # a fragment round at each sync point: merged, not refused
            for m in (0, 1):
                s.on_fragment(t, upload(m, due=step, base_version=s.version[0], c_steps=H, c_tokens=128 * H))
    assert s.refusals.by_learner == {1: 1} and s.alive() == [0, 1] and not s.final_started
    assert s.version[0] > STEPS // (2 * H) and s.stats.refused_rounds == 0  # merges went on all run
    # The final sync starts at the budget, from the honest learners' final uploads.
    final = dataclasses.replace(upload(0, due=STEPS, base_version=s.version[0], c_steps=1, c_tokens=128), final=True)
    s.on_fragment(t + STEP_S, final)
    assert s.final_started and s.refusals.by_field == {"metadata.step": 1}
