"""#23 case 10: a learner's hello carries the settings both ends must agree on; the syncer refuses
other settings with one line naming them, before anything else from that learner counts."""
import dataclasses

import pytest

from wan_diloco import spec
from wan_diloco.assemble import Assembly
from wan_diloco.core import ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.compression.frame import FORMAT_VERSION as CODEC_FORMAT_VERSION
from wan_diloco.core import fingerprint as fp
from wan_diloco.core.messages import PROTOCOL_VERSION
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


CHANGES = [
    ({"learner__sync_every": 16}, "schedule (learner.sync_every 16 vs 8)"),
    ({"learner__tau": 2}, "schedule (learner.tau 2 vs 1)"),
    ({"codec__bits": 8}, "codec format (codec.bits 8 vs 32)"),
    ({"run__run_id": "run-y"}, "run (run.run_id run-y vs run-x)"),
    ({"run__learners": 3}, "run (run.learners 3 vs 2)"),
    ({"model__d_ff": 128}, "layout (the model's fragments"),
    ({"run__fragmenter": "layer"}, "layout (run.fragmenter layer vs balanced"),
    ({"syncer__shards": 2}, "shard plan (syncer.shards 2 vs 1"),
]


@pytest.mark.parametrize("change, said", CHANGES)
def test_each_setting_that_differs_is_named_with_both_values(change, said):
    differ = fp.differences(SYNCER, fingerprint(**change))
    assert len(differ) == 1 and differ[0].startswith(said)


@pytest.mark.parametrize("change, said", CHANGES + [({"learner__num_fragments": 1}, "layout (the model's")])
def test_a_learner_with_other_settings_is_refused_at_hello_with_one_line_naming_them(change, said):
    """#24: another H, P, fragmenter, bits, shard plan or run id: the first metadata is refused, in one line."""
    core = SyncerCore(SyncerConfig(num_learners=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC)
    core.fingerprint = SYNCER
    with pytest.raises(ProtocolError) as e:
        core.on_metadata(0.0, dataclasses.replace(meta(1), fingerprint=fingerprint(**change)))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"learner 1: {fp.SETTINGS_DIFFER}: {said}")
    assert e.value.field == "fingerprint" and 1 not in core.learners


def test_the_protocol_and_codec_format_versions_are_part_of_the_fingerprint():
    assert SYNCER.startswith(f"protocol=version:{PROTOCOL_VERSION};")
    assert f"codec=format:{CODEC_FORMAT_VERSION}," in SYNCER and "offset:p*H//P" in SYNCER
    newer = SYNCER.replace(f"protocol=version:{PROTOCOL_VERSION}", f"protocol=version:{PROTOCOL_VERSION + 1}")
    assert fp.differences(SYNCER, newer) == [f"protocol version (protocol.version {PROTOCOL_VERSION + 1} vs "
                                             f"{PROTOCOL_VERSION})"]
    other = SYNCER.replace(f"format:{CODEC_FORMAT_VERSION}", f"format:{CODEC_FORMAT_VERSION + 1}")
    assert fp.differences(SYNCER, other) == [f"codec format (codec.format {CODEC_FORMAT_VERSION + 1} vs "
                                             f"{CODEC_FORMAT_VERSION})"]
    rule = SYNCER.replace("offset:p*H//P", "offset:(p+1)*H//P-1")
    assert fp.differences(SYNCER, rule) == ["schedule (learner.offset (p+1)*H//P-1 vs p*H//P)"]


def test_a_fingerprint_from_before_the_layout_named_its_fragmenter_still_compares():
    old = SYNCER.replace("layout=run.fragmenter:balanced,fragments:", "layout=")
    assert fp.differences(SYNCER, old) == [
        "layout (run.fragmenter missing vs balanced, the model's fragments: tensor names, shapes or dtypes; "
        "compare [model] and learner.num_fragments)"]


def test_the_fragment_count_changes_the_layout_and_the_schedule():
    assert fp.differences(SYNCER, fingerprint(learner__num_fragments=1)) == [
        "layout (the model's fragments: tensor names, shapes or dtypes; compare [model] and learner.num_fragments)",
        "schedule (learner.num_fragments 1 vs 2)"]


def test_settings_that_need_not_agree_leave_the_fingerprint_alone():
    assert fingerprint(run__steps=77, transport__channels=3, codec__impl="jnp") == SYNCER
    assert fp.differences(SYNCER, SYNCER) == []


def test_a_fingerprint_fits_one_metadata_field_even_with_long_values():
    long = fp.encode({"a": {f"k{i}": "v" * 20 for i in range(40)}, "b": {"x": 1}})
    assert len(long) <= fp.MAX_CHARS and fp.differences(long, long) == []
    assert fp.differences(long, long.replace("b=x:1", "b=x:2")) == ["b (b.x 2 vs 1)"]
    # Every setting readable (no component hashed) even with the longest of them all.
    longest = fingerprint(codec__bits=4, syncer__shards=2, run__run_id="r" * 24)
    assert len(longest) <= fp.MAX_CHARS and "learner=sync_every:8," in longest and "codec=format:" in longest
    m = dataclasses.replace(meta(0), fingerprint=longest)
    assert serde.metadata_from_frame(serde.to_frame(m), 2).fingerprint == longest
    with pytest.raises(ProtocolError, match="Metadata.fingerprint: expected a string of at most 512"):
        serde.to_frame(dataclasses.replace(meta(0), fingerprint="x" * 513))
    with pytest.raises(ProtocolError, match="Metadata.region: expected a string of at most 256"):
        serde.to_frame(dataclasses.replace(meta(0), region="x" * 257))


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


def test_a_hello_of_another_protocol_version_is_refused_before_its_fields_are_read():
    newer = SYNCER.replace(f"protocol=version:{PROTOCOL_VERSION}", f"protocol=version:{PROTOCOL_VERSION + 1}")
    frame = serde.to_frame(dataclasses.replace(meta(1), fingerprint=newer))
    frame = dataclasses.replace(frame, meta={**frame.meta, "a_field_of_version_2": 1})  # unknown here
    with pytest.raises(ProtocolError) as e:
        serde.metadata_from_frame(frame, 2)
    assert str(e.value) == (f"learner 1: {fp.SETTINGS_DIFFER}: protocol version (protocol.version "
                            f"{PROTOCOL_VERSION + 1} vs {PROTOCOL_VERSION})") and e.value.field == "fingerprint"
    # The same version, or none named (the simulator's empty fingerprint): read as usual.
    for same in (SYNCER, ""):
        ok = serde.to_frame(dataclasses.replace(meta(1), fingerprint=same))
        assert serde.metadata_from_frame(ok, 2).fingerprint == same
    assert fp.protocol_differs(None, PROTOCOL_VERSION) is None and fp.protocol_differs("junk", 1) is None
