"""#23 case 10: a learner's hello carries the settings both ends must agree on; the syncer refuses
other settings with one line naming them, before anything else from that learner counts."""
import dataclasses

import pytest

from wan_diloco import spec
from wan_diloco.assemble import Assembly
from wan_diloco.core import ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.core import fingerprint as fp
from wan_diloco.runtime import serde

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, meta, upload

TINY = {"model": {"preset": "micro"}, "learner": {"sync_every": 8, "num_fragments": 2, "tau": 1},
        "run": {"learners": 2, "run_id": "run-x"}}


BASE = Assembly(spec.from_document(TINY))


def fingerprint(**changes):
    doc = {k: dict(v) for k, v in TINY.items()}
    for key, v in changes.items():
        table, _, name = key.partition("__")
        doc.setdefault(table, {})[name] = v
    parts = Assembly(spec.from_document(doc))
    if parts.spec.model == BASE.spec.model:
        parts.__dict__["flat0"] = BASE.flat0  # the same model: its parameters need not be made again
    return parts.fingerprint


SYNCER = fingerprint()


@pytest.mark.parametrize("change, said", [
    ({"learner__sync_every": 16}, "schedule (learner.sync_every 16 vs 8)"),
    ({"learner__tau": 2}, "schedule (learner.tau 2 vs 1)"),
    ({"codec__bits": 8}, "codec format (codec.bits 8 vs 32)"),
    ({"run__run_id": "run-y"}, "run (run.run_id run-y vs run-x)"),
    ({"run__learners": 3}, "run (run.learners 3 vs 2)"),
    ({"model__d_ff": 128}, "layout (the model's fragments"),
])
def test_each_setting_that_differs_is_named_with_both_values(change, said):
    differ = fp.differences(SYNCER, fingerprint(**change))
    assert len(differ) == 1 and differ[0].startswith(said)


def test_the_fragment_count_changes_the_layout_and_the_schedule():
    assert fp.differences(SYNCER, fingerprint(learner__num_fragments=1)) == [
        "layout (the model's fragments: tensor names, shapes or dtypes; compare [model] and learner.num_fragments)",
        "schedule (learner.num_fragments 1 vs 2)"]


def test_settings_that_need_not_agree_leave_the_fingerprint_alone():
    assert fingerprint(run__steps=77, transport__channels=3, codec__impl="jnp") == SYNCER
    assert fp.differences(SYNCER, SYNCER) == []


def test_a_fingerprint_fits_one_metadata_field_even_with_long_values():
    long = fp.encode({"a": {f"k{i}": "v" * 20 for i in range(20)}, "b": {"x": 1}})
    assert len(long) <= serde.MAX_STR_CHARS and fp.differences(long, long) == []
    assert len(SYNCER) <= serde.MAX_STR_CHARS


def test_the_syncer_refuses_a_learner_with_other_settings_before_anything_else():
    core = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    core.fingerprint = SYNCER
    theirs = fingerprint(learner__sync_every=16)
    with pytest.raises(ProtocolError, match=r"^learner 1: settings differ from the syncer's: schedule "
                                            r"\(learner.sync_every 16 vs 8\)$"):
        core.on_metadata(0.0, dataclasses.replace(meta(1), fingerprint=theirs))
    assert 1 not in core.learners  # nothing of it was taken in: not even that it is alive
    with pytest.raises(ProtocolError, match="settings differ"):
        core.on_fragment(0.1, upload(1))
    core.on_metadata(0.2, dataclasses.replace(meta(1), fingerprint=SYNCER))  # restarted with the run's settings
    core.on_fragment(0.3, upload(1))
    core.on_metadata(0.4, meta(0))  # no fingerprint (the simulator's learners): not compared


def test_the_fingerprint_travels_in_metadata():
    m = dataclasses.replace(meta(0), fingerprint=SYNCER)
    assert serde.metadata_from_frame(serde.to_frame(m), 2).fingerprint == SYNCER
