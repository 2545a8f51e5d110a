"""Plausibility checks of the syncer core (#23): steps past a learner's pace, clock entries past what
the syncer issued, versions past the fragment's; refusals counted, logged rate-limited, and
quarantine after ``max_refusals``; learner states."""
import dataclasses

import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.config import ConfigError
from wan_diloco.core import ProtocolError, SyncerConfig, SyncerCore
from wan_diloco.core.pace import PACE_FACTOR
from wan_diloco.core.refusals import LOG_BURST
from wan_diloco.core.syncer import MAX_CLOCK

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, upload


def syncer(**kw):
    cfg = SyncerConfig(**{"num_learners": 3, "quorum": 1, "grace": False, **kw})
    return SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC)


def md(learner, step, clock=None):
    """A learner's metadata as an honest learner sends it: its clock ticks once a step."""
    from wan_diloco.core import Metadata

    c = min(step, 1)  # steps since a fragment's last sync: never more than the learner took
    return Metadata(learner=learner, step=step, c_steps=(c, c), c_tokens=(100 * c, 100 * c),
                    clock=VectorClock(clock if clock is not None else {f"learner-{learner}": step}), step_s=0.05)


def train(s, learner, steps, t0, step_s, first=1):
    """Report steps first..first+steps-1 at one every ``step_s`` from ``t0``; returns the time after."""
    t = t0
    for k in range(first, first + steps):
        t += step_s
        s.on_metadata(t, md(learner, k))
    return t


# ---- case 1: one report of step = run.steps ------------------------------------------------


@pytest.mark.parametrize("rogue", [0, 1])
def test_one_report_of_the_last_step_does_not_move_the_global_step(rogue):
    # Learner 0 at step 193 of 2400 at 20 steps/s; a token holder reports step 2400 as learner 1 (never
    # heard from) or as learner 0 itself. On main the global step became 2400: every learner jumped
    # there and the run ended as a success at 8 % of its budget.
    s = syncer(max_step=2408)
    t = train(s, 0, 193, 0.0, 0.05)
    with pytest.raises(ProtocolError, match="past what its pace allows") as e:
        s.on_metadata(t + 0.01, md(rogue, 2400, {f"learner-{rogue}": 200}))
    assert e.value.field == "metadata.step"
    assert s.global_step == 193 and s.learners[0].step == 193 and (rogue == 0 or 1 not in s.learners)
    assert s.refusals.by_field == {"metadata.step": 1} and s.refusals.by_learner == {rogue: 1}
    # ... and the learner goes on as before: nothing of the refused report stuck.
    train(s, 0, 10, t + 0.02, 0.05, first=194)
    assert s.global_step == 203


def test_a_flood_of_small_jumps_cannot_add_its_slack_up():
    s = syncer(step_slack=8)
    t = train(s, 0, 100, 0.0, 0.05)  # 20 steps/s: the pace bound is 4 x that
    accepted, step = 0, 100
    for i in range(1000):  # within 0.1 s, each report 8 steps past the last
        try:
            s.on_metadata(t + i * 1e-4, md(0, step + 8))
            step += 8
            accepted += 1
        except ProtocolError:
            pass
    # 8 steps of slack and 0.1 s x 80 steps/s: nowhere near the 8000 steps a per-message slack would allow.
    assert s.global_step <= 100 + 8 + 0.1 * PACE_FACTOR * 20 + 1
    assert accepted >= 1


def test_an_upload_due_past_the_learner_pace_is_refused():
    s = syncer()
    t = train(s, 0, 50, 0.0, 0.05)
    with pytest.raises(ProtocolError, match="due step 2400 is past what its pace allows") as e:
        s.on_fragment(t + 0.01, upload(0, due=2400, c_steps=1))
    assert e.value.field == "upload.due_step" and s.rounds == {} and s.stats.bytes_in == 0
    with pytest.raises(ProtocolError, match="pace"):
        s.on_fragment(t + 0.01, upload(2, due=2400, c_steps=1))  # never heard from: bounded by the global step
    s.on_fragment(t + 0.02, upload(0, due=52, c_steps=1))  # the upload of its next step arrives first: fine
    assert s.version[0] == 1


# ---- honest learners are never refused ------------------------------------------------------


def test_honest_learners_are_never_refused():
    s = syncer(num_learners=3)
    # Learner 0: a 30 s compile before its first step, then 1000 steps a second (a tiny model on a GPU).
    s.on_metadata(0.0, md(0, 0))
    t = train(s, 0, 3000, 30.0, 0.001)
    # Learner 1, slow, joins late and adopts the global step (one more after a late merge), then trains.
    s.on_metadata(t, md(1, 0))
    s.on_metadata(t + 0.2, md(1, s.global_step + 1, {"learner-1": 2}))
    # Learner 0 goes through a 60 s partition training on alone, and its first report after it holds all.
    t = train(s, 0, 5, t, 0.001, first=3001)
    s.on_metadata(t + 60.0, md(0, 3005 + 60_000))
    assert s.global_step == 63_005 and s.refusals.by_field == {}
    # Learner 2, after a syncer resume from a snapshot cut 30 s ago: it trained on (at 20 steps/s) meanwhile.
    r = syncer(num_learners=3)
    r.global_step = 1000
    r.resumed_after(100.0, 30.0)
    r.on_metadata(101.0, md(2, 1000 + 31 * 20))
    assert r.global_step == 1620


# ---- case 4: one clock entry of 2**53 ---------------------------------------------------------


@pytest.mark.parametrize("entry", [
    {"syncer": MAX_CLOCK},  # the syncer's own entry, far past what it issued
    {"learner-2": MAX_CLOCK},  # another learner's, far past what the syncer knows of it
    {"learner-0": MAX_CLOCK},  # the sender's own, advancing by far more than one message can
])
def test_a_poisoned_clock_entry_is_refused_and_merges_go_on(entry):
    # On main the entry was merged into the syncer's clock: its next tick went past the limit and every
    # later message was refused, for good, with nothing logged.
    s = syncer()
    s.on_metadata(0.0, md(0, 8))
    poisoned = dataclasses.replace(upload(0, due=8), clock=VectorClock({"learner-0": 9, **entry}))
    with pytest.raises(ProtocolError, match="past what the syncer issued or knows") as e:
        s.on_fragment(0.1, poisoned)
    assert e.value.field == "clock" and s.clock == VectorClock({"learner-0": 8}) and s.version == [0, 0]
    with pytest.raises(ProtocolError, match="past what the syncer issued or knows"):
        s.on_metadata(0.1, md(0, 9, {"learner-0": 9, **entry}))
    # The honest messages that follow merge, and the clock the update carries is an ordinary one.
    out = s.on_fragment(0.2, upload(0, due=8))
    assert s.version[0] == 1 and out[0].msg.clock == VectorClock({"learner-0": 8, "syncer": 1})
    ahead = dataclasses.replace(upload(0, fragment=1, due=10), clock=VectorClock({"learner-0": 10, "syncer": 1}))
    s.on_fragment(0.3, ahead)
    assert s.version == [1, 1] and s.clock["syncer"] == 2


def test_a_base_version_past_the_fragment_version_is_refused():
    s = syncer()
    s.on_metadata(0.0, md(0, 8))
    with pytest.raises(ProtocolError, match="base version 5 of fragment 0 is past its current version 0") as e:
        s.on_fragment(0.1, upload(0, due=8, base_version=5))
    assert e.value.field == "upload.base_version" and s.version == [0, 0] and s.rounds == {}
    # An earlier incarnation's version (a syncer resumed from a snapshot) is not this one's: dropped, not refused.
    s.epoch = 2
    s.on_fragment(0.2, dataclasses.replace(upload(0, due=8, base_version=5), epoch=1))
    assert s.stats.stale_epoch == 1 and s.refusals.by_field == {"upload.base_version": 1}


# ---- refusals: counted, logged rate-limited, quarantine -----------------------------------------


def test_refusals_are_counted_logged_rate_limited_and_quarantine_after_max_refusals():
    s = syncer(max_refusals=20, quarantine_s=60.0)
    s.on_metadata(0.0, md(0, 5))
    s.on_metadata(0.0, md(1, 5))
    before = len(s.notices)
    for i in range(19):
        with pytest.raises(ProtocolError):
            s.on_metadata(0.01 * i, md(1, 10**6, {"learner-1": 6}))
    assert 1 not in s.quarantined and s.refusals.by_learner == {1: 19}
    # One line per refusal at first, naming the sender and the field; then none, so a flood cannot fill the log.
    lines = list(s.notices)[before:]
    assert len(lines) == LOG_BURST and all("learner 1 [metadata.step]" in x for x in lines)
    with pytest.raises(ProtocolError):
        s.on_metadata(0.2, md(1, 10**6, {"learner-1": 6}))
    assert 1 in s.quarantined and s.learner_state(1) == "quarantined" and "20 messages refused" in s.notices[-1]
    # Its messages are refused while quarantined (counted, toward nothing more); the run goes on.
    with pytest.raises(ProtocolError, match="quarantined"):
        s.on_metadata(0.3, md(1, 6))
    assert s.refusals.by_field == {"metadata.step": 20, "quarantined": 1}
    s.on_fragment(0.4, upload(0, due=6))
    assert s.version[0] == 1 and s.learner_state(0) == "alive"
    # Refusals spread wider than quarantine_s quarantine nothing.
    w = syncer(max_refusals=3, quarantine_s=1.0)
    for t in (0.0, 2.0, 4.0, 6.0):
        with pytest.raises(ProtocolError):
            w.on_metadata(t, md(0, 10**6, {"learner-0": 1}))
    assert w.quarantined == {}


def test_a_refusal_from_an_unknown_learner_id_is_counted_but_attributed_to_no_one():
    s = syncer()
    with pytest.raises(ProtocolError):
        s.on_metadata(0.0, md(7, 1, {}))
    assert s.refusals.by_field == {"learner": 1} and s.refusals.by_learner == {}


# ---- learner states (case 10: never connected is waiting, not alive) ----------------------------


def test_learners_never_heard_from_are_waiting_not_alive():
    s = syncer(num_learners=4, liveness_timeout_s=30.0)
    s.tick(0.0)
    s.on_metadata(1.0, md(0, 1))
    assert [s.learner_state(m) for m in range(4)] == ["alive", "waiting", "waiting", "waiting"]
    assert s.connected() == [0] and s.alive() == [0, 1, 2, 3]  # the quorum still expects them
    s.tick(40.0)  # everyone timed out: learner 0 is lost, the others were never there
    assert [s.learner_state(m) for m in range(4)] == ["lost", "waiting", "waiting", "waiting"]
    assert s.connected() == []


# ---- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    ({"step_slack": 0}, "step_slack"), ({"step_slack": 2.5}, "step_slack"),
    ({"max_steps_per_s": 0.0}, "max_steps_per_s"), ({"max_steps_per_s": float("inf")}, "max_steps_per_s"),
    ({"max_refusals": 0}, "max_refusals"),
])
def test_bad_plausibility_settings_name_the_key(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        SyncerConfig(**kw).validate()


def test_a_configured_pace_replaces_the_measured_one():
    s = syncer(max_steps_per_s=10.0, step_slack=4)
    s.on_metadata(0.0, md(0, 0))
    s.on_metadata(1.0, md(0, 14))  # 4 + 10 x 1 s
    with pytest.raises(ProtocolError, match="10 steps/s"):
        s.on_metadata(1.0, md(0, 15))
    assert np.isclose(s.pace.rate(0), 10.0)


# ---- counters, timings, incarnations: what the hostile harness found taken -----------------------


@pytest.mark.parametrize("change, field", [
    ({"c_steps": (9, 1)}, "metadata.c_steps"),  # more steps since a sync than the learner took
    ({"c_steps": (-1, 1)}, "metadata.c_steps"),
    ({"c_tokens": (2**63 - 1, 100)}, "metadata.c_tokens"),  # would outweigh every other learner's Δ
    ({"tokens": 2**63 - 1}, "metadata.tokens"),
    ({"step_s": 1e308}, "metadata.step_s"),  # bounds the grace window
    ({"step_s": -1.0}, "metadata.step_s"),
    ({"sync_s": -1.0}, "metadata.sync_s"),
    ({"epoch": 2}, "metadata.epoch"),  # an incarnation this syncer never was
    ({"snapshot": 2**63 - 1}, "metadata.snapshot"),
])
def test_counters_and_timings_no_honest_learner_reports_are_refused_without_a_trace(change, field):
    s = syncer(max_tokens_per_step=100)
    s.on_metadata(0.0, md(0, 8))
    before = (s.global_step, dict(s.learners[0].__dict__))
    honest = dataclasses.replace(md(0, 8), c_steps=(8, 1), c_tokens=(800, 100), tokens=800, step_s=0.2, epoch=1)
    s.on_metadata(0.1, honest)  # at the limits: taken
    with pytest.raises(ProtocolError) as e:
        s.on_metadata(0.2, dataclasses.replace(honest, **change))
    assert e.value.field == field and s.refusals.by_field == {field: 1}
    assert s.global_step == before[0] == 8


@pytest.mark.parametrize("change, field", [
    ({"c_steps": 8 + 32 + 1}, "upload.c_steps"),
    ({"c_tokens": 801}, "upload.c_tokens"),
    ({"epoch": 2}, "upload.epoch"),
    ({"final": True}, "upload.final"),  # a final upload before the run's budget would end the run for all
])
def test_uploads_with_counters_no_honest_learner_sends_are_refused(change, field):
    s = syncer(max_tokens_per_step=100, final_min_step=200)
    s.on_metadata(0.0, md(0, 8))
    with pytest.raises(ProtocolError) as e:
        s.on_fragment(0.1, dataclasses.replace(upload(0, due=8), **change))
    assert e.value.field == field and not s.final_started and s.version == [0, 0] and not s.rounds
    # The same upload within the limits is taken.
    assert s.on_fragment(0.2, upload(0, due=8)) and s.version[0] == 1


def test_a_final_upload_at_the_runs_budget_is_taken():
    s = syncer(final_min_step=8)
    s.on_metadata(0.0, md(0, 8))
    s.on_fragment(0.1, dataclasses.replace(upload(0, due=8), final=True))
    assert s.final_started and s.refusals.by_field == {}
