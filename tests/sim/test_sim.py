import numpy as np
import pytest

from wan_diloco import sim, train
from wan_diloco.assemble import Assembly
from wan_diloco.config import ConfigError
from wan_diloco.tape import Outage

from .micro import micro


def simulation(spec, outages=()):
    return sim.Simulation(spec, Assembly(spec), list(outages))


def run_sim(spec, outages=()):
    s = simulation(spec, outages)
    return s, s.run()


def test_decoupled_run_learns_syncs_and_survives_a_failure():
    # step = 0.5 virtual s: learner 2 is down for global steps ~10..24
    s, r = run_sim(micro(), [Outage(learner=2, down_at=5.0, up_at=12.0)])
    assert r.final_eval_loss < r.initial_eval_loss - 0.5
    assert all(n >= 48 // 8 - 1 for n in r.fragment_syncs)  # every fragment synced every H steps
    for l in s.learners:  # counters were reset at each sync, never accumulated over the run
        assert max(l.core.c_steps) <= 8 + 2
    history = list(s.syncer.stats.history)
    during = [c for t, _, _, c in history if 5.2 < t < 12.0]
    after = [c for t, _, _, c in history if t > 16.0]
    assert during and all(2 not in c for c in during)
    assert any(2 in c for c in after)
    assert 0.5 < r.goodput < 0.95  # the outage cost learner 2's share
    assert r.uptime == pytest.approx(1.0)
    assert r.bytes_sent > 0 and r.tokens > 0
    # core.evals' rule: the start, each multiple of 16 reached, then the end (after the final sync)
    steps = [p["step"] for p in r.curve]
    assert [s // 16 for s in steps[:-1]] == [0, 1, 2, 3] and steps[-1] == r.global_steps


def test_messages_a_learner_had_in_flight_die_with_it():
    # Steps end every 0.5 s; learner 2's metadata of its step ending at 5.0 s is on the wire until
    # 5.03 s, and at 0.0005 Gbit/s an upload is on the wire for about half a second.
    cfg = micro(bandwidth_gbit_s=0.0005)
    s = simulation(cfg, [Outage(learner=2, down_at=5.01, up_at=12.0)])
    heard = []
    for name in ("on_metadata", "on_fragment"):
        def record(now_s, msg, _handler=getattr(s.syncer, name)):
            heard.append((now_s, msg.learner))
            return _handler(now_s, msg)
        setattr(s.syncer, name, record)
    waited = []
    close = s.syncer._close
    s.syncer._close = lambda now_s, key, final=False: (waited.append((now_s, s.syncer.alive())), close(now_s, key, final))[1]
    s.run()
    assert not [t for t, m in heard if m == 2 and 5.01 <= t < 12.0]
    during = [alive for t, alive in waited if 5.01 <= t < 12.0]
    assert during and all(2 not in alive for alive in during)  # no round waited for the dead learner
    assert any(m == 2 for t, m in heard if t > 12.0)


@pytest.mark.parametrize("failover", [True, False])
def test_live_learners_read_a_down_learners_shard(failover):
    cfg = micro(steps=24, data_failover=failover)
    s = simulation(cfg, [Outage(learner=2, down_at=3.0, up_at=8.0)])
    asked = []
    for m, l in enumerate(s.learners):
        def record(down=frozenset(), _m=m, _next=l.batches.next):
            asked.append((_m, s.now, down))
            return _next(down)
        l.batches.next = record
    s.run()
    during = {down for m, t, down in asked if 3.5 < t < 8.0}
    assert during == ({frozenset({2})} if failover else {frozenset()})
    assert all(m != 2 for m, t, _ in asked if 3.0 <= t < 8.0)
    assert {down for _, t, down in asked if t > 10.0} == {frozenset()}


def test_recovering_learner_applies_updates_sent_during_its_transfer():
    # 0.002 Gbit/s: the donor's state (~0.7 MB) takes ~2.6 virtual s on each of the two links it crosses
    # (sim/donations.py), during which fragments sync.
    cfg = micro(steps=48, bandwidth_gbit_s=0.002)
    s = simulation(cfg, [Outage(learner=2, down_at=3.0, up_at=5.0)])
    reached, seen = [], {}
    deliver, rejoin = s._deliver, s._rejoin

    def record(m, life, msg):
        if m == 2 and "versions" not in seen:
            reached.append((msg.fragment, msg.to_version))
        deliver(m, life, msg)

    def check(m, life):
        seen["versions"] = list(s.learners[m].core.version)
        rejoin(m, life)

    s._deliver, s._rejoin = record, check
    s.run()
    (rec,) = [f for f in s.faults if f["event"] == "recovered"]
    synced = [t for t, *_ in s.syncer.stats.history if 5.0 < t < rec["at_s"]]
    assert len(synced) >= 2 and rec["replayed"] >= 2  # fragments synced while the state travelled, kept meanwhile ...
    # ... and applied in order on top of it: it starts with every update that reached it (later ones are on its link)
    assert reached and all(seen["versions"][p] >= v for p, v in reached)


def test_token_budget_schedule_follows_the_runs_tokens():
    # 24 steps of 3 learners x 4 x 32 tokens; learner 2 is down from 2 s (step 4) to past the end.
    cfg = micro(tokens=24 * 3 * 4 * 32, eval_every=100)
    s, r = run_sim(cfg, [Outage(learner=2, down_at=2.0, up_at=1000.0)])
    assert r.tokens >= cfg.simulate.tokens
    for l in s.learners[:2]:
        assert l.core.step >= 32  # the live learners took more steps than the schedule has ...
        assert 22 <= int(train.schedule_step(l.state)) <= 25  # ... but the schedule ran at the run's pace


def test_runs_are_deterministic_for_a_seed():
    a = sim.run(micro(steps=12, eval_every=12))
    b = sim.run(micro(steps=12, eval_every=12))
    assert a.final_eval_loss == b.final_eval_loss and a.bytes_sent == b.bytes_sent
    c = sim.run(micro(steps=12, eval_every=12, seed=1))
    assert c.final_eval_loss != a.final_eval_loss


def test_eval_set_does_not_depend_on_the_training_batch():
    # Runs with different batches must be compared on the same held-out text.
    a = Assembly(micro(batch_size=2))
    b = Assembly(micro(batch_size=8))
    assert a.evaluate(a.state0.params) == b.evaluate(b.state0.params)
    c = Assembly(micro(batch_size=2, eval_batch_size=4))
    assert c.evaluate(c.state0.params) != a.evaluate(a.state0.params)


def test_dp_stalls_while_a_learner_is_down():
    outage = [Outage(learner=1, down_at=2.0, up_at=8.0)]
    dp = sim.run(micro(baseline="dp", steps=16), outage)
    dec = sim.run(micro(steps=16), outage)
    assert dp.final_eval_loss < dp.initial_eval_loss
    assert dp.goodput < dec.goodput
    assert dp.uptime < 0.9 and dec.uptime == pytest.approx(1.0)


def test_synchronous_baselines_block_and_sync_whole_model():
    r = sim.run(micro(baseline="diloco", steps=16))
    assert r.fragment_syncs == [16 // 8]  # one fragment: the sync at step 8, then the final one
    s = sim.run(micro(baseline="streaming", steps=16))
    assert len(s.fragment_syncs) == 4 and s.final_eval_loss < s.initial_eval_loss


@pytest.mark.parametrize(
    "kw, field",
    [({"quorum": 4}, "quorum"), ({"speeds": (1.0,)}, "speeds"), ({"baseline": "x"}, "baseline"),
     ({"preset": "huge"}, "preset"), ({"tau": -1}, "tau"), ({"eval_batch_size": 0}, "eval_batch_size")],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        micro(**kw)


def test_bad_outage_rejected():
    with pytest.raises(ConfigError, match="learner 7"):
        sim.run(micro(), [Outage(learner=7, down_at=1.0, up_at=2.0)])


def test_quantized_wire_is_smaller_and_every_copy_bit_identical():
    s32, r32 = run_sim(micro(steps=16))
    s4, r4 = run_sim(micro(steps=16, bits=4, error_feedback=True))
    assert r4.bytes_sent * 6 < r32.bytes_sent  # NF4 + scales + zstd vs fp32
    assert r4.final_eval_loss < r4.initial_eval_loss - 0.3
    for l in s4.learners:  # after the final sync every learner holds exactly the syncer's Θ
        for p, frag in enumerate(s4.syncer.theta):
            for n, a in frag.items():
                np.testing.assert_array_equal(l.core.base[p][n], a)
    assert any(l.core.feedback.residual(0) is not None for l in s4.learners)


def test_sharded_syncer_merges_like_one_when_merges_take_no_time():
    one = sim.run(micro(steps=24, eval_every=24, grace=False))
    two = sim.run(micro(steps=24, eval_every=24, grace=False, shards=2))
    assert two.final_eval_loss == one.final_eval_loss and two.fragment_syncs == one.fragment_syncs
    assert two.params.keys() == one.params.keys()
    assert all((two.params[n] == one.params[n]).all() for n in one.params)


@pytest.mark.slow  # two simulated runs: about a minute
def test_too_few_shards_for_the_merge_work_show_as_waiting():
    # A merge of one ~33 kB fragment takes 1.6 virtual s at 2e-5 GB/s, and a fragment is due every second
    # (H/P = 2 steps of 0.5 s): one shard falls behind and its rounds queue; four shards (one fragment each,
    # due every 4 s) keep up, and the learners get their updates sooner after sending.
    kw = dict(steps=24, eval_every=24, grace=False, shard_merge_gb_s=2e-5, merge_takes_time=True, sync_every=8)
    s1, one = run_sim(micro(**kw, shards=1))
    s4, four = run_sim(micro(**kw, shards=4))
    assert [len(c.owned) for c in s4.syncer.cores] == [1, 1, 1, 1]
    assert s1.syncer.queued_s > 10 * max(s4.syncer.queued_s, 0.1)
    lag = lambda s: sum(l.core.merge_lag_steps for l in s.learners) / sum(l.core.merge_lags for l in s.learners)  # noqa: E731
    assert lag(s4) < lag(s1)


@pytest.mark.slow  # a simulated run of 24 steps, then its replay: ~17 s of CPU, 90 s wall on the loaded cores
def test_staleness_options_replay_bit_identically_on_a_bare_syncer_core():
    # K = 1 without grace: each round closes on its first Δ, the others are carried one version stale.
    spec = micro(steps=24, eval_every=24, grace=False, rtt_s=2.0, staleness="gate", staleness_power=2.0, eager=True,
                 bits=4, error_feedback=True)
    s = simulation(spec)
    calls = []
    for name in ("on_metadata", "on_fragment", "on_timer", "on_peer_lost"):
        def record(now_s, msg, _f=getattr(s.syncer, name), _name=name):
            calls.append((_name, now_s, msg))
            return _f(now_s, msg)
        setattr(s.syncer, name, record)
    s.run()
    core = Assembly(spec).syncer_core()
    seen = []
    gains = core.outer.gains
    core.outer.gains = lambda p, stale, deltas: seen.append(max(stale)) or gains(p, stale, deltas)
    for name, now_s, msg in calls:
        getattr(core, name)(now_s, msg)
    assert max(seen) >= 1  # stale Δs were merged, so the gate ran
    assert core.version == s.syncer.version
    for p, frag in enumerate(s.syncer.theta):
        for n, a in frag.items():
            np.testing.assert_array_equal(core.theta[p][n], a)
            for l in s.learners:  # eager learners end on the global model, as every learner does
                np.testing.assert_array_equal(l.core.base[p][n], a)
