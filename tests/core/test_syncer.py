import dataclasses
import itertools

import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import (
    FINAL_TIMER, Broadcast, FragmentUpload, LearnerConfig, LearnerCore, ProtocolError, SetTimer, SyncerConfig,
    SyncerCore,
)
from wan_diloco.fragments import Layout
from wan_diloco.outer import OuterConfig

from .helpers import CODEC, FRAGS, PARAMS, is_embedding, meta, upload


def make(**kw):
    cfg = SyncerConfig(**{"num_learners": 3, "tau": 2, **kw})
    return SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC)


def test_quorum_one_without_grace_merges_at_once():
    s = make(quorum=1, grace=False, outer=OuterConfig(lr=1.0, momentum=0.0))
    [b] = s.on_fragment(0.0, upload(0))
    assert isinstance(b, Broadcast) and b.msg.contributors == (0,)
    assert (b.msg.from_version, b.msg.to_version) == (0, 1)
    np.testing.assert_allclose(s.theta[0]["block_0/w"], PARAMS["block_0/w"] - 0.1, rtol=1e-6)
    assert s.stats.fragment_syncs == [1, 0]


def test_quorum_then_grace_then_everyone_in_closes_early():
    s = make(quorum=2, grace=True)
    for m in range(3):
        s.on_metadata(0.0, meta(m, step_s=1.0))
    assert s.on_fragment(1.0, upload(0)) == []  # below quorum
    [timer] = s.on_fragment(1.2, upload(1))  # quorum reached: grace = 0.8 * (2*1.0 - 0.2 - 0) = 1.44
    assert isinstance(timer, SetTimer)
    assert timer.at_s == pytest.approx(1.2 + 0.8 * (2.0 - 0.2))
    [b] = s.on_fragment(1.5, upload(2))  # last live learner arrives inside the grace: close now
    assert b.msg.contributors == (0, 1, 2)
    assert s.on_timer(timer.at_s, timer.key) == []  # the round is gone
    assert list(s.stats.quorum_sizes) == [3]


def test_grace_expiry_closes_with_quorum_and_late_one_is_dropped_without_carry():
    s = make(quorum=1, grace=True, carry_late=False)
    for m in range(3):
        s.on_metadata(0.0, meta(m, step_s=1.0))
    [timer] = s.on_fragment(1.0, upload(0))
    [b] = s.on_timer(timer.at_s, timer.key)
    assert b.msg.contributors == (0,)
    assert s.on_fragment(timer.at_s + 0.1, upload(1)) == []
    assert s.stats.late_dropped == 1 and s.carried[0] == {}


def test_late_delta_joins_the_fragments_next_merge():
    s = make(quorum=1, grace=False)
    [first] = s.on_fragment(1.0, upload(0, due=8))
    theta1 = dict(s.theta[0])
    d_late = np.full(3, 0.3, np.float32)
    assert s.on_fragment(1.5, upload(1, due=8, delta=d_late)) == []  # round 8 closed: carried
    assert s.stats.late_dropped == 0 and s.carried[0].keys() == {1}
    d0 = np.full(3, 0.2, np.float32)
    [b] = s.on_fragment(9.0, upload(0, due=16, delta=d0, base_version=1))
    assert b.msg.contributors == (0, 1)  # learner 1's fresh Δ for 16 has not come; its late one rides along
    assert s.stats.late_carried == 1 and s.carried[0] == {}
    assert list(s.stats.quorum_sizes) == [1, 2]
    assert set(b.msg.held_s) == {0}  # no held time for a carried Δ: it would skew that learner's sync estimate
    # The merge saw both Δs: RDA of two parallel Δs is their weighted mean, so Θ moved by more than d0 alone gives.
    moved = theta1["block_0/w"] - s.theta[0]["block_0/w"]
    only0 = make(quorum=1, grace=False)
    only0.on_fragment(1.0, upload(0, due=8))
    only0.on_fragment(9.0, upload(0, due=16, delta=d0, base_version=1))
    assert np.all(moved > theta1["block_0/w"] - only0.theta[0]["block_0/w"])


def test_late_deltas_of_one_learner_are_summed():
    s = make(quorum=1, grace=False)
    s.on_fragment(1.0, upload(0, due=8))
    s.on_fragment(1.5, upload(1, due=8, delta=np.full(3, 0.3, np.float32), c_steps=8, c_tokens=800))
    s._carry(upload(1, due=8, delta=np.full(3, 0.1, np.float32), c_steps=2, c_tokens=200))
    held = s.carried[0][1]
    np.testing.assert_allclose(held.delta["block_0/w"], 0.4)
    assert held.c_steps == 10 and held.c_tokens == 1000 and held.payload is None


def test_too_stale_carried_delta_is_dropped():
    s = make(quorum=1, grace=False, max_staleness=0)
    s.on_fragment(1.0, upload(0, due=8))
    s.on_fragment(1.5, upload(1, due=8, base_version=1))  # late, but built on the current Θ: carried
    s.carried[0][1] = dataclasses.replace(s.carried[0][1], base_version=0)
    [b] = s.on_fragment(9.0, upload(0, due=16, base_version=1))
    assert b.msg.contributors == (0,) and s.stats.stale_dropped == 1


def test_no_grace_flag_and_no_estimates_give_zero_grace():
    assert make(grace=False).grace_window_s() == 0.0
    assert make(grace=True).grace_window_s() == 0.0  # nothing measured yet
    s = make(grace=True)
    s.on_metadata(0.0, meta(0, step_s=1.0, sync_s=5.0))  # sync slower than τ steps: no slack
    assert s.grace_window_s() == 0.0


def test_grace_respects_the_smallest_overlap_the_learners_report():
    s = make(grace=True)  # configured tau = 2
    s.on_metadata(0.0, meta(0, step_s=1.0))
    assert s.tau_now() == 2 and s.grace_window_s() == pytest.approx(0.8 * 2.0)
    s.on_metadata(0.0, meta(1, step_s=1.0, tau=4))  # a learner on a slow link re-planned to 4
    s.on_metadata(0.0, meta(2, step_s=1.0, tau=3))
    assert s.tau_now() == 3 and s.grace_window_s() == pytest.approx(0.8 * 3.0)
    s.on_metadata(1.0, meta(2, step_s=1.0))  # no tau in this report: the last one stands
    assert s.tau_now() == 3


def test_an_impossible_overlap_is_refused_without_state_change():
    s = make(grace=True)
    with pytest.raises(ProtocolError, match="tau must be in"):
        s.on_metadata(0.0, meta(0, step_s=1.0, tau=10**6))
    assert s.tau_now() == 2 and s.global_step == 0 and s.learners == {}


def test_lost_peer_is_not_waited_for():
    s = make(quorum=3, grace=False)
    for m in range(3):
        s.on_metadata(0.0, meta(m))
    s.on_fragment(1.0, upload(0))
    assert s.on_fragment(1.0, upload(1)) == []
    [b] = s.on_peer_lost(2.0, 2)
    assert b.msg.contributors == (0, 1)


def test_liveness_timeout_via_tick():
    s = make(quorum=2, grace=False, liveness_timeout_s=5.0)
    s.on_metadata(0.0, meta(0))
    s.on_metadata(0.0, meta(1))
    assert s.on_fragment(4.0, upload(0)) == []
    assert s.tick(4.5) == []
    [b] = s.tick(6.0)  # learner 1 silent for 6 s > 5 s
    assert b.msg.contributors == (0,)


def test_token_weights_shape_the_merge():
    s = make(quorum=2, grace=False, merge="mean", outer=OuterConfig(lr=1.0, momentum=0.0))
    s.on_fragment(0.0, upload(0, delta=np.ones(3, np.float32), c_tokens=300, c_steps=3))
    [b] = s.on_fragment(0.0, upload(1, delta=np.zeros(3, np.float32), c_tokens=100, c_steps=1))
    # w0 = 300*100 = 30000, w1 = 100*100 = 10000 -> mean 0.75
    np.testing.assert_allclose(b.msg.update["block_0/w"], -0.75, rtol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(learner=7), "learner id 7"),
        (dict(fragment=5), "fragment 5"),
        (dict(delta={"block_0/w": np.ones(4, np.float32)}), "shape"),
        (dict(delta={"block_0/w": np.array([1.0, np.nan, 0.0], np.float32)}), "NaN"),
        (dict(delta={"other": np.ones(3, np.float32)}), "missing"),
        (dict(c_steps=-1), "negative"),
    ],
)
def test_malformed_upload_rejected_without_state_change(bad, match):
    s = make(quorum=2)
    s.on_fragment(0.0, upload(0))
    snapshot = lambda: (repr(s.rounds), s.stats, [dict(f) for f in s.theta], list(s.version), s.clock)
    before = snapshot()
    with pytest.raises(ProtocolError, match=match):
        s.on_fragment(0.1, dataclasses.replace(upload(1), **bad))
    assert repr(snapshot()) == repr(before)


def test_stale_base_dropped():
    s = make(quorum=1, grace=False, max_staleness=0)
    s.on_fragment(0.0, upload(0, due=8))
    assert s.version[0] == 1
    assert s.on_fragment(0.1, upload(1, due=16, base_version=0)) == []
    assert s.stats.stale_dropped == 1


def test_learner_copy_is_bit_identical_to_syncer():
    s = make(quorum=1, grace=False)
    lc = LearnerCore(LearnerConfig(sync_every=8, num_fragments=2), 0, FRAGS, PARAMS, CODEC)
    for due in (8, 16, 24):
        [b] = s.on_fragment(float(due), upload(0, due=due, base_version=s.version[0]))
        lc.on_update(float(due), b.msg)
    np.testing.assert_array_equal(lc.base[0]["block_0/w"], s.theta[0]["block_0/w"])
    assert lc.version[0] == s.version[0] == 3


def final(learner, fragment, due=9, **kw):
    return dataclasses.replace(upload(learner, fragment=fragment, due=due, **kw), final=True)


def test_final_sync_waits_for_every_live_learner_then_merges_all_at_once():
    s = make(quorum=1, grace=False, outer=OuterConfig(lr=1.0, momentum=0.0))
    for m in range(3):
        s.on_metadata(0.0, meta(m))
    [timer] = s.on_fragment(1.0, final(0, 0))
    assert timer.key == FINAL_TIMER and timer.at_s == pytest.approx(1.0 + s.cfg.final_timeout_s)
    assert s.on_fragment(1.0, final(0, 1)) == [] and not s.final_done  # quorum 1 does not apply to the final sync
    s.on_fragment(1.1, final(1, 0))
    s.on_fragment(1.1, final(1, 1))
    assert s.on_peer_lost(1.2, 2) != [] and s.final_done  # the last live learner went away: merge now
    assert s.final_participants() == {0, 1}
    assert s.version == [1, 1] and [h[3] for h in list(s.stats.history)[-2:]] == [(0, 1), (0, 1)]
    assert s.on_fragment(2.0, final(2, 0)) == []  # too late: ignored, nothing changes
    assert s.version == [1, 1]


def test_final_sync_broadcasts_final_updates_that_learners_apply():
    s = make(num_learners=2, quorum=2, grace=False)
    learners = [LearnerCore(LearnerConfig(sync_every=8, num_fragments=2), m, FRAGS, PARAMS, CODEC) for m in range(2)]
    out = []
    for m, lc in enumerate(learners):
        lc.begin_step(0.0)
        lc.step_done(0.5, 10)
        snaps = lc.finish()
        assert [a.fragment for a in snaps] == [0, 1] and all(a.final for a in snaps)
        for a in snaps:
            theta = {n: PARAMS[n] + 0.25 * (m + 1) for n in FRAGS[a.fragment]}
            [send] = lc.snapshot(1.0, a.fragment, a.due_step, theta, a.final)
            assert send.msg.final
            out += s.on_fragment(1.0, send.msg)
    assert [type(a) for a in out] == [SetTimer, Broadcast, Broadcast] and all(a.msg.final for a in out[1:])
    for lc in learners:
        for b in out[1:]:
            lc.on_update(1.1, b.msg)
        for p, frag in enumerate(s.theta):
            for n, a in frag.items():
                np.testing.assert_array_equal(lc.base[p][n], a)


def test_final_timer_merges_what_arrived():
    s = make(quorum=1)
    for m in range(3):
        s.on_metadata(0.0, meta(m))
    [timer] = s.on_fragment(1.0, final(0, 0))
    assert s.on_timer(timer.at_s, timer.key) != [] and s.final_done
    assert s.version == [1, 0]  # only fragment 0 had a final upload


def test_a_shard_merges_its_fragments_only_and_refuses_the_others():
    full, shard1 = make(quorum=1, grace=False), SyncerCore(
        SyncerConfig(num_learners=3, tau=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, CODEC, owned=[1])
    assert shard1.theta[0] == {} and set(shard1.outer.states) == {1}
    with pytest.raises(ProtocolError, match=r"this syncer shard owns fragments \[1\] only"):
        shard1.on_fragment(0.0, upload(0, fragment=0))
    assert shard1.stats.bytes_in == 0 and shard1.version == [0, 0]
    [a] = full.on_fragment(0.0, upload(0, fragment=1))
    [b] = shard1.on_fragment(0.0, upload(0, fragment=1))
    assert a.msg.update.keys() == b.msg.update.keys()
    for n in a.msg.update:  # the same merge as an unsharded syncer's, bit for bit
        assert (a.msg.update[n] == b.msg.update[n]).all()
    assert shard1.version == [0, 1]


def test_a_shards_final_sync_waits_for_its_fragments_only():
    s = SyncerCore(SyncerConfig(num_learners=2, tau=2, quorum=1), FRAGS, PARAMS, is_embedding, CODEC, owned=[0])
    first = s.on_fragment(0.0, dataclasses.replace(upload(0, fragment=0), final=True))
    assert [type(a) for a in first] == [SetTimer]
    [b] = s.on_fragment(0.1, dataclasses.replace(upload(1, fragment=0), final=True))
    assert isinstance(b, Broadcast) and b.msg.final and b.msg.fragment == 0 and s.final_done


def test_a_shards_snapshot_restores_into_the_same_shard_only():
    cfg = SyncerConfig(num_learners=3, tau=2, quorum=1, grace=False)
    s = SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC, owned=[1])
    s.on_fragment(0.0, upload(0, fragment=1))
    tensors, info = s.export()
    assert all(k.startswith(("theta/1/", "outer/1")) for k in tensors)
    again = SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC, owned=[1])
    again.restore(tensors, info)
    assert again.version == [0, 1] and (again.theta[1]["embed/embedding"] == s.theta[1]["embed/embedding"]).all()
    other = SyncerCore(cfg, FRAGS, PARAMS, is_embedding, CODEC, owned=[0])
    with pytest.raises(ValueError, match="owning fragments \\[1\\], this one owns \\[0\\]"):
        other.restore(tensors, info)
    assert other.version == [0, 0]


@pytest.mark.parametrize("owned", [[], [2], [-1]])
def test_owned_fragments_must_be_a_subset(owned):
    with pytest.raises(ValueError, match="owned fragments must be a non-empty subset of 0..1"):
        SyncerCore(SyncerConfig(num_learners=3, tau=2), FRAGS, PARAMS, is_embedding, CODEC, owned=owned)


def _sq(theta):
    return float(sum(np.sum(a.astype(np.float64) ** 2) for a in theta.values()))


def test_the_cached_theta_norm_follows_every_merge_and_restore():
    s = make(quorum=1, grace=False, max_delta_ratio=1.0)
    s.on_fragment(0.0, upload(0))
    assert s.theta_sq[0] == pytest.approx(_sq(s.theta[0]), rel=1e-6)  # set by the merge, for the next check
    tensors, info = s.export()
    s.on_fragment(1.0, upload(1, due=16, base_version=1))
    assert s.version[0] == 2 and s.theta_sq[0] == pytest.approx(_sq(s.theta[0]), rel=1e-6)
    # A snapshot with a far larger Θ: the next check must use its norm, not the cached one.
    tensors = {**tensors, "theta/0/block_0/w": np.full(3, 100.0, np.float32)}
    s.restore(tensors, info)
    assert s.theta_sq == [None, None]
    big = np.full(3, 20.0, np.float32)  # |Δ| = 34.6: over 1 x |Θ| = 3.7 before, under 173 after
    [b] = s.on_fragment(2.0, dataclasses.replace(upload(2, due=24, delta=big, base_version=1), epoch=0))
    assert b.msg.to_version == 2 and s.theta_sq[0] == pytest.approx(_sq(s.theta[0]), rel=1e-6)


def test_nan_in_one_of_several_tensors_is_refused_naming_it():
    frags = [("block_0/w", "block_0/v")]
    params = {"block_0/w": np.ones(3, np.float32), "block_0/v": np.ones(2, np.float32)}
    from wan_diloco.compression import CodecConfig, FragmentCodec
    from wan_diloco.fragments import Layout
    codec = FragmentCodec(CodecConfig(bits=32), Layout(frags, {n: a.shape for n, a in params.items()}))
    s = SyncerCore(SyncerConfig(num_learners=2, quorum=2), frags, params, is_embedding, codec)
    bad = dataclasses.replace(upload(0), delta={"block_0/w": np.zeros(3, np.float32),
                                                "block_0/v": np.float32([0.0, np.inf])})
    with pytest.raises(ProtocolError, match="'block_0/v' from learner 0: NaN or Inf"):
        s.on_fragment(0.0, bad)
    assert s.rounds == {} and s.stats.quarantines == 0 and 0 not in s.learners


def test_a_snapshot_of_the_optax_state_layout_restores():
    """Snapshots written while the outer step ran in optax (state: optax's pytree) still restore."""
    import optax

    from wan_diloco import tree
    s = make(quorum=1, grace=False)
    s.on_fragment(0.0, upload(0))
    tensors, info = s.export()
    tx = optax.sgd(0.4, momentum=0.6, nesterov=True)
    old = {k: v for k, v in tensors.items() if not k.startswith("outer/")}
    for p, names in enumerate(FRAGS):
        state = tx.init({n: PARAMS[n] for n in names})
        state = (state[0]._replace(trace={n: np.full(PARAMS[n].shape, 0.25, np.float32) for n in names}), state[1])
        old.update(tree.to_named(state, f"outer/{p}"))
    assert old.keys() == tensors.keys()
    again = make(quorum=1, grace=False)
    again.restore(old, info)
    assert (again.outer.states[0][0].trace["block_0/w"] == 0.25).all()
    [b] = again.on_fragment(1.0, dataclasses.replace(upload(1, due=16, base_version=1), epoch=0))
    assert b.msg.to_version == 2 and (again.outer.states[0][0].trace["block_0/w"] != 0.25).all()


def test_a_syncer_with_worker_threads_merges_bit_identically():
    from wan_diloco.merge import CHUNK
    frags = [("block_0/w",)]
    rng = np.random.default_rng(1)
    params = {"block_0/w": rng.normal(size=2 * CHUNK + 5).astype(np.float32)}
    from wan_diloco.compression import CodecConfig, FragmentCodec
    from wan_diloco.fragments import Layout
    codec = FragmentCodec(CodecConfig(bits=8), Layout(frags, {"block_0/w": params["block_0/w"].shape}))
    deltas = [rng.normal(size=params["block_0/w"].shape).astype(np.float32) * 0.01 for _ in range(2)]
    out = []
    for workers in (1, 2):
        s = SyncerCore(SyncerConfig(num_learners=2, quorum=2, grace=False), frags, params, is_embedding, codec,
                       workers=workers)
        for k in range(2):  # two rounds: the momentum carries over
            for m in range(2):
                up = dataclasses.replace(upload(m, due=8 * (k + 1), base_version=k), delta={"block_0/w": deltas[m]})
                got = s.on_fragment(float(k), up)
        out.append((got[0].msg.payload, s.theta[0]["block_0/w"], s.outer.states[0][0].trace["block_0/w"]))
    assert out[0][0] == out[1][0]
    np.testing.assert_array_equal(out[0][1], out[1][1])
    np.testing.assert_array_equal(out[0][2], out[1][2])


def test_a_round_folds_each_delta_into_its_sums_as_it_arrives():
    s = make(quorum=3, grace=False)
    for m in range(2):
        assert s.on_fragment(0.0, upload(m)) == []
    rnd = s.rounds[(0, 8)]
    assert rnd.sums is not None and rnd.sums.count == 2 and rnd.held == set()
    assert all(u.delta == {} for u in rnd.contributions.values())  # no decoded Δ held
    [b] = s.on_fragment(0.1, upload(2))
    assert b.msg.contributors == (0, 1, 2)


def test_a_learners_delta_waits_whole_while_its_late_one_is_carried_and_both_merge_as_one():
    s = make(quorum=1, grace=False, merge="mean", outer=OuterConfig(lr=1.0, momentum=0.0))
    s.on_fragment(1.0, upload(0, due=8, delta=np.zeros(3, np.float32)))
    assert s.on_fragment(1.5, upload(1, due=8, delta=np.full(3, 0.3, np.float32))) == []  # late: carried
    theta = s.theta[0]["block_0/w"].copy()
    [b] = s.on_fragment(9.0, upload(1, due=16, delta=np.full(3, 0.2, np.float32), base_version=1))
    assert b.msg.contributors == (1,) and s.carried[0] == {} and s.stats.late_carried == 1
    np.testing.assert_allclose(s.theta[0]["block_0/w"], theta - 0.5, rtol=1e-6)  # its whole displacement


def test_the_syncer_gives_the_same_bits_on_any_number_of_threads():
    from wan_diloco.merge import CHUNK
    frags = [("block_0/w", "block_0/b")]
    params = {"block_0/w": np.zeros(2 * CHUNK + 9, np.float32), "block_0/b": np.ones(7, np.float32)}
    codec = FragmentCodec(CodecConfig(bits=4), Layout(frags, {n: a.shape for n, a in params.items()}))
    rng = np.random.default_rng(3)
    payloads = [codec.encode({n: (rng.standard_normal(a.shape) * 1e-2).astype(np.float32) for n, a in params.items()})
                for _ in range(6)]
    thetas, sent = [], []
    # Decoded, or kept in its codes and folded from them (the runtime's syncer): the same bits either way.
    for threads, deferred in itertools.product((1, 2, 4), (False, True)):
        s = SyncerCore(SyncerConfig(num_learners=3, quorum=3, grace=False, threads=threads), frags, params,
                       is_embedding, codec)
        out = []
        for r in range(2):
            for m in range(3):
                delta = codec.decode(0, payloads[3 * r + m], deferred=deferred)
                up = FragmentUpload(learner=m, fragment=0, due_step=8 * (r + 1), base_version=r, c_steps=8,
                                    c_tokens=800 * (m + 1), clock=VectorClock({f"learner-{m}": 8 * (r + 1)}),
                                    delta=delta, nbytes=1)
                out = s.on_fragment(float(r), up)
        thetas.append({n: a.view(np.uint32) for n, a in s.theta[0].items()})
        sent.append(out[0].msg.payload)
    for t, p in zip(thetas[1:], sent[1:]):
        assert p == sent[0]
        for n in t:
            np.testing.assert_array_equal(t[n], thetas[0][n])


def test_a_delta_kept_in_its_codes_merges_whole_when_its_late_one_is_carried():
    # Learner 1's late Δ is carried; its next Δ, kept in its codes, waits whole and is decoded to be
    # combined with it: the same Θ as from decoded Δs.
    layout = Layout(FRAGS, {n: a.shape for n, a in PARAMS.items()})
    codec = FragmentCodec(CodecConfig(bits=4, block_size=16), layout)
    pays = [codec.encode({"block_0/w": np.array(v, np.float32)}) for v in ([0.0, 0.1, 0.2], [0.3, 0.1, -0.3],
                                                                           [0.2, 0.2, -0.1])]
    thetas = []
    for deferred in (False, True):
        s = SyncerCore(SyncerConfig(num_learners=3, tau=2, quorum=1, grace=False), FRAGS, PARAMS, is_embedding, codec)

        def up(m, due, i, base=0):
            return dataclasses.replace(upload(m, due=due, base_version=base),
                                       delta=codec.decode(0, pays[i], deferred=deferred))
        s.on_fragment(1.0, up(0, 8, 0))
        assert s.on_fragment(1.5, up(1, 8, 1)) == []  # late: carried
        [b] = s.on_fragment(9.0, up(1, 16, 2, base=1))
        assert b.msg.contributors == (1,) and s.stats.late_carried == 1
        thetas.append(s.theta[0]["block_0/w"].tobytes())
    assert thetas[0] == thetas[1]


def test_threads_must_be_a_count_of_cores():
    SyncerConfig(threads=0).validate()
    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="threads"):
            SyncerConfig(threads=bad).validate()


def test_a_handed_over_delta_is_dropped_once_folded_and_any_other_is_left_alone():
    layout = Layout(FRAGS, {n: a.shape for n, a in PARAMS.items()})
    codec = FragmentCodec(CodecConfig(bits=4, block_size=16), layout)
    s = SyncerCore(SyncerConfig(num_learners=3, quorum=3, grace=False), FRAGS, PARAMS, is_embedding, codec)
    payload = codec.encode({"block_0/w": np.full(3, 0.1, np.float32)})
    mine = codec.decode(0, payload)  # the caller's own: kept
    handed = codec.decode(0, payload)
    handed.handed_over = True  # as the runtime's serde marks what it decoded for the upload alone
    s.on_fragment(0.0, dataclasses.replace(upload(0), delta=mine))
    s.on_fragment(0.1, dataclasses.replace(upload(1), delta=handed))
    assert list(mine) == ["block_0/w"] and handed == {}
    assert s.rounds[(0, 8)].sums.count == 2
