from dataclasses import replace

import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.config import ConfigError
from wan_diloco.core import (
    ApplyGlobal, GlobalUpdate, LearnerConfig, LearnerCore, Resync, SendFragment, SendMetadata, Snapshot,
)

from .helpers import CODEC, FRAGS, PARAMS


def make(**kw):
    cfg = LearnerConfig(**{"sync_every": 4, "num_fragments": 2, "tau": 1, **kw})
    return LearnerCore(cfg, 0, FRAGS, PARAMS, CODEC)


def step(lc, t, tokens=100):
    lc.begin_step(t)
    return lc.step_done(t + 1.0, tokens)


def update(p, frm, to, values, global_step=0, held=None):
    return GlobalUpdate(fragment=p, from_version=frm, to_version=to, due_step=4, global_step=global_step,
                        clock=VectorClock({"syncer": to}), update=values, nbytes=0, held_s=held or {})


def test_counts_and_due_fragments():
    lc = make()
    kinds = []
    for t in range(8):
        acts = step(lc, float(t))
        assert isinstance(acts[-1], SendMetadata)
        kinds += [(lc.step, a.fragment) for a in acts if isinstance(a, Snapshot)]
    assert kinds == [(2, 1), (4, 0), (6, 1), (8, 0)]  # offsets 0 and 2 in a period of 4
    assert lc.c_steps == [8, 8] and lc.c_tokens == [800, 800]
    assert lc.metadata().step_s == pytest.approx(1.0)


def test_snapshot_sends_base_minus_theta():
    lc = make()
    theta = {"block_0/w": PARAMS["block_0/w"] + 0.5}
    [send] = lc.snapshot(0.0, 0, 4, theta)
    assert isinstance(send, SendFragment)
    np.testing.assert_allclose(send.msg.delta["block_0/w"], -0.5)
    assert send.msg.base_version == 0 and send.msg.due_step == 4 and send.msg.nbytes == len(send.msg.payload)
    np.testing.assert_array_equal(CODEC.decode(0, send.msg.payload)["block_0/w"], send.msg.delta["block_0/w"])


def test_update_between_steps_applies_and_resets_counters():
    lc = make()
    for t in range(3):
        step(lc, float(t))
    acts = lc.on_update(5.0, update(0, 0, 1, {"block_0/w": np.ones(3, np.float32)}, global_step=7))
    [apply] = acts
    assert isinstance(apply, ApplyGlobal) and apply.alpha == 0.0
    np.testing.assert_allclose(apply.values["block_0/w"], PARAMS["block_0/w"] + 1)
    assert lc.c_steps == [0, 3] and lc.version == [1, 0]
    assert lc.step == 7  # adopted the global step


@pytest.mark.parametrize("contributors, expected", [
    ((1, 2), 6),  # missed: one past the reported global step, the quorum has stepped since it was counted
    ((0, 1), 5),  # in its round: the global step alone
])
def test_a_learner_whose_delta_missed_its_round_steps_back_into_phase(contributors, expected):
    lc = make()
    for t in range(4):
        step(lc, float(t))
    lc.snapshot(5.0, 0, 4, {"block_0/w": PARAMS["block_0/w"]})
    u = update(0, 0, 1, {"block_0/w": np.zeros(3, np.float32)}, global_step=5)
    lc.on_update(6.0, replace(u, contributors=contributors))
    assert lc.step == expected


def test_merge_lag_counts_steps_trained_between_sending_and_merging_the_answer():
    lc = make()
    for t in range(4):
        step(lc, float(t))
    lc.snapshot(4.0, 0, 4, {"block_0/w": PARAMS["block_0/w"]})  # sent after step 4
    for t in range(4, 7):
        step(lc, float(t))
    lc.on_update(8.0, update(0, 0, 1, {"block_0/w": np.zeros(3, np.float32)}))
    lc.on_update(9.0, update(1, 0, 1, {"embed/embedding": np.zeros((1, 2), np.float32)}))  # none of ours in flight
    assert (lc.merge_lags, lc.merge_lag_steps) == (1, 3)


def test_keep_local_keeps_the_steps_taken_while_the_fragment_travelled():
    lc = make(keep_local=True)
    for t in range(4):
        step(lc, float(t))  # fragment 0 is due at step 4
    snap = {"block_0/w": PARAMS["block_0/w"] - 0.5}
    lc.snapshot(4.0, 0, 4, snap)
    step(lc, 4.0, tokens=70)  # one more step while Δ travels: θ moves on to snap - 0.25
    now = {"block_0/w": snap["block_0/w"] - 0.25}
    [apply] = lc.on_update(6.0, update(0, 0, 1, {"block_0/w": np.full(3, -0.4, np.float32)}))
    assert apply.shift
    new = apply.mixed(now)["block_0/w"]
    # θ ← Θ_new + (θ_now − θ_snapshot): the new global value, plus the one step kept.
    np.testing.assert_allclose(new, PARAMS["block_0/w"] - 0.4 - 0.25)
    assert lc.c_steps[0] == 1 and lc.c_tokens[0] == 70  # that step stays counted for the next Δ
    # The next Δ is measured from the new base, so the kept step is sent exactly once.
    [send] = lc.snapshot(7.0, 0, 8, {"block_0/w": new})
    np.testing.assert_allclose(send.msg.delta["block_0/w"], 0.25, rtol=1e-6)


def test_keep_local_without_a_snapshot_in_flight_overwrites():
    lc = make(keep_local=True)
    step(lc, 0.0)
    [apply] = lc.on_update(2.0, update(0, 0, 1, {"block_0/w": np.ones(3, np.float32)}))
    assert not apply.shift and apply.alpha == 0.0
    np.testing.assert_allclose(apply.mixed({"block_0/w": np.zeros(3)})["block_0/w"], PARAMS["block_0/w"] + 1)
    assert lc.c_steps[0] == 0


def test_keep_local_and_alpha_are_exclusive():
    with pytest.raises(ConfigError, match="alpha"):
        make(keep_local=True, alpha=0.5)


def test_alpha_mixes():
    a = ApplyGlobal(0, {"w": np.full(2, 4.0)}, 0.25)
    np.testing.assert_allclose(a.mixed({"w": np.zeros(2)})["w"], 3.0)


def test_update_during_step_is_buffered_until_step_done():
    lc = make()
    lc.begin_step(0.0)
    assert lc.on_update(0.5, update(0, 0, 1, {"block_0/w": np.ones(3, np.float32)})) == []
    acts = lc.step_done(1.0, 100)
    assert any(isinstance(a, ApplyGlobal) for a in acts)
    assert lc.c_steps[0] == 0  # reset after this step's count: the update came last


def test_version_gap_asks_for_resync_and_duplicates_are_ignored():
    lc = make()
    [r] = lc.on_update(0.0, update(0, 1, 2, {"block_0/w": np.ones(3, np.float32)}))
    assert isinstance(r, Resync) and (r.have_version, r.want_version) == (0, 2)
    lc.resync(0, {"block_0/w": np.zeros(3, np.float32)}, 2)
    assert lc.on_update(0.0, update(0, 1, 2, {"block_0/w": np.ones(3, np.float32)})) == []
    assert lc.version[0] == 2 and not lc.base[0]["block_0/w"].any()


def test_blocking_learner_waits_tau_steps_after_sending():
    lc = make(blocking=True, tau=1)
    for t in range(4):
        step(lc, float(t))
    lc.snapshot(4.0, 0, 4, {"block_0/w": PARAMS["block_0/w"]})
    assert not lc.blocked  # may still train τ = 1 step
    step(lc, 4.0)
    assert lc.blocked
    lc.on_update(6.0, update(0, 0, 1, {"block_0/w": np.zeros(3, np.float32)}, held={0: 0.5}))
    assert not lc.blocked
    assert lc.sync_s.value == pytest.approx(6.0 - 4.0 - 0.5)
    assert not make(blocking=False).blocked


def test_error_feedback_carries_what_was_dropped():
    class Round1:  # a "codec" that rounds to 1 decimal
        def roundtrip(self, values):
            from wan_diloco.fragments import Encoded
            return Encoded({n: np.round(v, 1) for n, v in values.items()}, 0)

    lc = LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, error_feedback=True), 0, FRAGS, PARAMS, codec=Round1())
    true_sum, sent_sum = np.zeros(3), np.zeros(3)
    for i in range(20):
        theta = {"block_0/w": PARAMS["block_0/w"] - 0.04}  # true Δ = 0.04 every time
        [s] = lc.snapshot(float(i), 0, 4 * (i + 1), theta)
        true_sum += 0.04
        sent_sum += s.msg.delta["block_0/w"]
        assert np.all(np.abs(true_sum - sent_sum) <= 0.05 + 1e-6)  # bounded by one rounding step
    assert abs(sent_sum[0] - 0.8) < 0.06  # without feedback every round sends 0.0


def test_step_done_without_begin_is_an_error():
    with pytest.raises(RuntimeError):
        make().step_done(0.0, 1)


def test_retune_changes_tau_and_refuses_a_bad_one_without_changing_state():
    lc = make(tau=0)
    lc.retune(3)
    assert lc.cfg.tau == 3
    with pytest.raises(ConfigError, match="tau"):
        lc.retune(lc.cfg.sync_every)
    assert lc.cfg.tau == 3


def test_sync_in_flight_must_be_a_whole_number_from_zero():
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="sync_in_flight"):
            make(sync_in_flight=bad)
    make(sync_in_flight=0)


def test_a_begun_snapshot_encodes_from_the_base_it_was_taken_on():
    # The driver's worker encodes after the training thread merged an update of the same fragment:
    # the upload is still the one a snapshot at once would have sent (counters, clock, Δ).
    theta = {"block_0/w": np.array([0.5, 2.5, 2.0], np.float32)}
    now, later = make(error_feedback=True), make(error_feedback=True)
    for lc in (now, later):
        step(lc, 0.0)
    [send] = now.snapshot(2.0, 0, 1, theta)
    pending = later.begin_snapshot(2.0, 0, 1)
    assert later.in_flight.keys() == {0} and later.clock == now.clock
    later.on_update(2.5, update(0, 0, 1, {"block_0/w": np.ones(3, np.float32)}))
    assert later.version[0] == 1
    msg = later.encode_snapshot(pending, theta)
    fields = ("fragment", "due_step", "base_version", "c_steps", "c_tokens", "clock", "nbytes", "payload", "epoch")
    assert [getattr(msg, f) for f in fields] == [getattr(send.msg, f) for f in fields]
    assert (msg.base_version, msg.c_steps, msg.due_step) == (0, 1, 1)
    np.testing.assert_array_equal(msg.delta["block_0/w"], PARAMS["block_0/w"] - theta["block_0/w"])
    assert later.feedback.state_dict().keys() == now.feedback.state_dict().keys()


def test_eager_steps_the_fragment_by_its_own_delta_then_rebases_the_steps_since_onto_the_global():
    lc = LearnerCore(LearnerConfig(sync_every=4, num_fragments=2, tau=1, eager=True), 0, FRAGS, PARAMS, CODEC,
                     outer_lr=0.4)
    base = PARAMS["block_0/w"]
    for t in range(4):
        step(lc, float(t))
    theta = {"block_0/w": base + np.array([0.5, -1.0, 0.25], np.float32)}
    send, standin = lc.snapshot(4.0, 0, 4, theta)
    assert isinstance(send, SendFragment) and isinstance(standin, ApplyGlobal) and not standin.shift
    local = base.astype(np.float64) - theta["block_0/w"]  # Δ_local
    np.testing.assert_allclose(standin.values["block_0/w"], base - 0.4 * local, rtol=1e-6)
    np.testing.assert_array_equal(send.msg.delta["block_0/w"], (base - theta["block_0/w"]).astype(np.float32))
    trained = {"block_0/w": standin.mixed(theta)["block_0/w"] + np.float32(0.125)}  # a step while in flight
    step(lc, 4.0)
    u = np.array([0.1, 0.2, -0.3], np.float32)
    [rebase] = lc.on_update(6.0, update(0, 0, 1, {"block_0/w": u}, held={0: 0.0}))
    assert rebase.shift
    # θ_p ← Θ_new + (θ_local − stand-in): the in-flight step is kept, on top of the global update.
    np.testing.assert_allclose(rebase.mixed(trained)["block_0/w"], base + u + 0.125, rtol=1e-6)
    assert lc.c_steps[0] == 1  # that step counts into the next Δ


def test_eager_sets_no_stand_in_for_the_final_sync_and_refuses_alpha():
    lc = make(eager=True)
    assert [type(a) for a in lc.snapshot(0.0, 0, 4, {"block_0/w": PARAMS["block_0/w"] + 1}, final=True)] == [SendFragment]
    with pytest.raises(ConfigError, match="alpha"):
        make(eager=True, alpha=0.5)
