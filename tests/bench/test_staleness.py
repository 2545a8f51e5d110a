"""The delay sweep (bench/staleness.py): each row's settings, and one tiny sweep end to end."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/staleness.py imports bench/quality.py as ``quality``
_spec = importlib.util.spec_from_file_location("bench_staleness", BENCH / "staleness.py")
staleness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(staleness)

from wan_diloco import spec as spec_lib  # noqa: E402


@pytest.mark.parametrize("option", list(staleness.OPTIONS))
@pytest.mark.parametrize("lag", [0, 5, 16])
def test_a_rows_lag_is_its_link_round_trip_and_its_option_is_set(option, lag):
    spec = spec_lib.from_short(**staleness.row_overrides(option, 8, lag, seed=2))
    assert spec.simulate.rtt_s == lag * staleness.STEP_TIME_S
    assert spec.learner.tau == min(lag, spec.learner.sync_every - 1)  # the grace window expects the lag
    assert spec.run.learners == 8 and spec.run.seed == 2 and spec.codec.bits == 4 and spec.learner.error_feedback
    assert spec.syncer.outer.staleness == {"scale": "scale", "gate": "gate"}.get(option, "none")
    assert spec.learner.eager == (option == "eager")


@pytest.mark.slow  # two tiny simulated runs: about a minute on two loaded cores
def test_a_tiny_sweep_writes_its_rows_and_figure(tmp_path):
    out = tmp_path / "staleness.json"
    argv = ["--tokens", "6000", "--lags", "12", "--learners", "4", "--options", "nesterov", "gate",
            "--eval-batches", "1", "--jobs", "1", "--out", str(out)]
    assert staleness.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"nesterov_m4_lag12_s0", "gate_m4_lag12_s0"}
    for name, r in doc["runs"].items():
        assert r["sweep"] == {"option": name.split("_")[0], "learners": 4, "lag": 12, "seed": 0}
        assert r["final_eval_loss"] > 0 and r["outer"]["staleness"] == ("gate" if name.startswith("gate") else "none")
    assert out.with_suffix(".png").stat().st_size > 0
    # A rerun with another option keeps the rows it does not redo.
    assert staleness.main(argv[:7] + ["eager"] + argv[9:]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"nesterov_m4_lag12_s0", "gate_m4_lag12_s0", "eager_m4_lag12_s0"}
