"""SyncerCore's timing hook: a profiler (bench/syncer.py) sees every stage of the hot path by name, nested as
the work is, and timing changes nothing the core decides or sends."""
import contextlib

import numpy as np

from wan_diloco.core import SyncerConfig, SyncerCore
from wan_diloco.core.syncer import TIMED_STAGES

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload


def core(timing=None):
    cfg = SyncerConfig(num_learners=2, quorum=2, grace=False, tau=2)
    return SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC, timing=timing)


def test_every_stage_is_entered_by_name_and_nested_as_the_work_is():
    seen = []

    @contextlib.contextmanager
    def timing(stage):
        seen.append(f"+{stage}")
        yield
        seen.append(f"-{stage}")

    s = core(timing)
    assert s.on_fragment(0.0, upload(0)) == []
    assert len(s.on_fragment(0.5, upload(1))) == 1  # the round closed
    # Each Δ is folded into the round's sums as it arrives; the close finishes the merge.
    arrive = ["+validate_upload", "-validate_upload", "+validate_norm", "-validate_norm", "+merge", "-merge"]
    assert seen == arrive + arrive + ["+close", "+merge", "-merge", "+outer_step", "-outer_step",
                                      "+encode", "-encode", "+outer_step", "-outer_step", "-close"]
    assert {x[1:] for x in seen} == set(TIMED_STAGES)
    before = list(seen)
    s.timing = lambda stage: contextlib.nullcontext()  # a profiler may swap its hook between measurements
    s.on_fragment(1.0, upload(0, due=16, base_version=1))
    assert seen == before


def test_timing_changes_nothing_the_core_sends():
    untimed, timed = core(), core(lambda stage: contextlib.nullcontext())
    out = []
    for s in (untimed, timed):
        s.on_fragment(0.0, upload(0))
        [b] = s.on_fragment(0.5, upload(1))
        out.append(b.msg)
    assert out[0].payload == out[1].payload and out[0].to_version == out[1].to_version == 1
    for name in PARAMS:
        for p in range(len(FRAGS)):
            if name in untimed.theta[p]:
                np.testing.assert_array_equal(untimed.theta[p][name], timed.theta[p][name])
