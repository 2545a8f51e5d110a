"""runtime.replan: τ planned from the measured link once steps are timed, re-planned only on a confirmed move."""
import json
import types

from wan_diloco.core import LearnerConfig
from wan_diloco.core.protocol import Ema
from wan_diloco.runtime.replan import REPLAN_MIN_STEPS, Replanner
from wan_diloco.spec import PlanConfig


class Core:
    """What the replanner reads of a LearnerCore (its step, step time and τ) and the one call it makes."""

    def __init__(self):
        self.step, self.step_s, self.cfg = 0, Ema(), LearnerConfig(sync_every=8, num_fragments=2, tau=1)

    def begin_step(self, now_s):
        self.began_s = now_s

    def step_done(self, now_s, n_tokens):
        self.step += 1
        self.step_s.add(now_s - self.began_s)

    def retune(self, tau):
        self.cfg = LearnerConfig(sync_every=8, num_fragments=2, tau=tau)


def sample(rate_gbit_s, rtt_s=0.05):
    return types.SimpleNamespace(rate_gbit_s=rate_gbit_s, rtt_s=rtt_s,
                                 to_event=lambda: {"rate_gbit_s": rate_gbit_s, "rtt_ms": rtt_s * 1e3})


def setup():
    cfg = types.SimpleNamespace(plan=PlanConfig(adapt_tau=True, replan_confirm=2, max_tau=5),
                                learner=types.SimpleNamespace(sync_every=8, num_fragments=2))
    core = Core()
    return Replanner(cfg, 0, "us-east", max_fragment_bytes=50_000_000), core


def steps(core, n, step_s=0.1):
    for _ in range(n):
        core.begin_step(0.0)
        core.step_done(step_s, 100)


def test_a_sample_before_the_step_time_is_known_waits_then_plans_tau(capsys):
    rp, core = setup()
    rp.on_link(sample(1.0), core, payload_bytes=0, uploads=0)
    assert core.cfg.tau == 1 and rp.unplanned is not None  # τ counts steps: none timed yet
    steps(core, REPLAN_MIN_STEPS)
    rp.after_step(core, payload_bytes=0, uploads=0)
    # 50 MB at 1 Gbit/s: a 0.4 s upload each way is more than 5 steps of 0.1 s: capped at max_tau.
    assert core.cfg.tau == 5 and rp.unplanned is None
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in said] == ["link", "replan"] and said[1]["tau_old"] == 1
    assert "first plan" in said[1]["reasons"][0]


def test_only_a_move_seen_in_probes_in_a_row_replans_and_uploads_size_the_fragment(capsys):
    rp, core = setup()
    steps(core, REPLAN_MIN_STEPS)
    rp.on_link(sample(1.0), core, payload_bytes=10 * 100_000, uploads=10)  # 100 kB per fragment on the wire
    first = core.cfg.tau
    rp.on_link(sample(0.001), core, payload_bytes=10 * 100_000, uploads=10)  # one noisy probe: no re-plan
    assert core.cfg.tau == first
    rp.on_link(sample(0.001), core, payload_bytes=10 * 100_000, uploads=10)  # confirmed: 1 Mbit/s now
    assert core.cfg.tau > first
    plans = [e for e in map(json.loads, capsys.readouterr().out.splitlines()) if e["event"] == "replan"]
    assert len(plans) == 2 and plans[0]["fragment_bytes"] == 100_000
    assert any("2 probes in a row" in r for r in plans[1]["reasons"])
