"""The quality benchmark's failure tape (the benchmark itself is too long for the test run)."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_quality", Path(__file__).parents[2] / "bench" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.4])
def test_failure_tape_keeps_learners_down_the_asked_share(fraction):
    tape = quality.failure_tape(4, 1000.0, fraction, seed=7)
    assert quality.down_share(tape, 4, 1000.0) == pytest.approx(fraction, abs=0.02)
    assert {o.learner for o in tape} <= set(range(4)) and all(o.down_at < o.up_at for o in tape)
    assert max(o.down_at for o in tape) > 1000.0  # outages go on past the expected end
    assert tape == quality.failure_tape(4, 1000.0, fraction, seed=7)  # deterministic


def test_failure_tape_gives_up_on_an_impossible_share():
    with pytest.raises(RuntimeError, match="tape seed"):
        quality.failure_tape(1, 1000.0, 0.25, seed=0, cycles=1, tolerance=1e-9)


def test_every_row_runs_under_the_stated_deployment():
    dep = quality.deployment("tiny")
    # The Decoupled row (fp32, H = 8) uses the share of its link that a 10B run at H = 100, 4 bits, 1 s
    # steps uses of 2 Gbit/s: 10e9 x 4 / 100 / 1 s = 0.4 Gbit/s, a fifth.
    assert dep["params"] == 853_120 and dep["step_time_s"] == 0.5 and dep["step_noise"] == 0.1
    assert dep["link_share"] == pytest.approx(0.2)
    assert dep["bandwidth_gbit_s"] == pytest.approx(853_120 * 32 / 8 / 0.5 / 0.2 / 1e9)
    assert dep["rtt_s"] == pytest.approx(0.04)
    common = dict(preset="tiny", tokens=250_000, batch_size=1, eval_every=12, seed=0,
                  **quality.deployment_settings(dep))
    for name, overrides in quality.runs(8).items():
        settings, failures = quality.row_settings(overrides, common)
        sim = quality.spec_lib.from_short(**settings).simulate
        assert (sim.bandwidth_gbit_s, sim.rtt_s, sim.step_time_s, sim.step_noise) == (
            dep["bandwidth_gbit_s"], dep["rtt_s"], 0.5, 0.1), name
        assert sim.speeds == (overrides.get("speeds") or ()), name  # the hetero rows keep their slow learner
        assert failures == overrides.get("failures", False), name
