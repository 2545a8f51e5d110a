"""The quality benchmark: its failure tape, deployment, and results file (on tiny real runs)."""
import importlib.util
import json
import math
import os
import subprocess
import sys
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


# The writer on real runs kept tiny: 2048 tokens (4 dp steps) and a one-batch eval set (--eval-batches).
TINY = ["--tokens", "2048", "--eval-batches", "1", "--jobs", "1"]
SCHEMA = {"final_eval_loss", "goodput", "tokens", "wan_bytes", "seed", "outer", "config", "curve"}


def _check_row(name, r):
    assert SCHEMA <= set(r), name
    assert math.isfinite(r["final_eval_loss"]) and r["tokens"] > 0 and r["wan_bytes"] > 0, name
    assert r["seed"] == r["config"]["run"]["seed"] == 0, name
    if r["config"]["simulate"]["baseline"] == "dp":
        assert r["outer"] is None  # data parallel has no outer optimizer
    else:  # every field of the row's syncer.outer, whatever fields the config has
        assert r["outer"] == r["config"]["syncer"]["outer"] and {"lr", "momentum", "nesterov"} <= set(r["outer"])


def test_a_stopped_run_keeps_its_finished_rows_and_a_rerun_keeps_those_it_does_not_redo(tmp_path, monkeypatch,
                                                                                         capsys):
    out = tmp_path / "q.json"
    real_run, calls = quality.sim.run, []

    def run_then_fail(*a, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # what a stopped benchmark sees
        return real_run(*a, **kw)

    monkeypatch.setattr(quality.sim, "run", run_then_fail)
    with pytest.raises(KeyboardInterrupt):  # runs start in --only's order: decoupled, then dp_failures
        quality.main(["--only", "decoupled", "dp_failures", "--out", str(out), *TINY])
    doc = json.loads(out.read_text())
    assert list(doc["runs"]) == ["decoupled"]
    _check_row("decoupled", doc["runs"]["decoupled"])
    dep = doc["deployment"]
    assert dep == json.loads(json.dumps(quality.deployment("tiny")))
    assert dep["step_noise"] == 0.1 and dep["failure_tape"]["down_fraction"] == quality.DOWN_FRACTION
    assert (doc["tokens"], doc["eval_batches"], doc["seed"], doc["holdout"]) == (2048, 1, 0, "eval")
    assert doc["runs"]["decoupled"]["config"]["data"]["holdout"] == "eval"

    with pytest.raises(KeyboardInterrupt):  # stopped again, before its only row finishes
        quality.main(["--only", "dp_failures", "--out", str(out), *TINY])
    assert "keeping decoupled; running dp_failures" in capsys.readouterr().out
    assert json.loads(out.read_text()) == doc
    with pytest.raises(KeyboardInterrupt):  # --fresh drops the old rows at once
        quality.main(["--only", "dp_failures", "--out", str(out), "--fresh", *TINY])
    assert json.loads(out.read_text())["runs"] == {}


@pytest.mark.parametrize("change, named", [(["--tokens", "4096"], "tokens"), (["--seed", "1"], "seed"),
                                           (["--bandwidth-gbit", "1"], "deployment"),
                                           (["--holdout", "validation"], "holdout")])  # header without one: eval
def test_rows_from_other_settings_are_refused_and_left_as_they_were(tmp_path, monkeypatch, capsys, change, named):
    out = tmp_path / "q.json"
    header = dict(preset="tiny", tokens=2048, batch_size=1, quick=False, seed=0, sync_every=8, eval_batches=1,
                  deployment=quality.deployment("tiny"))
    quality.write_rows(out, json.loads(json.dumps(header)), {"dp": {"final_eval_loss": 3.9}}, ["dp"])
    before = out.read_bytes()
    monkeypatch.setattr(quality.sim, "run", lambda *a, **kw: pytest.fail("ran with an incompatible --out"))
    with pytest.raises(SystemExit) as e:
        quality.main(["--only", "decoupled", "--out", str(out), *TINY, *change])
    assert e.value.code == 2 and out.read_bytes() == before
    err = capsys.readouterr().err
    assert f"other {named} than this run" in err and "--fresh" in err


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"runs": 3}'])
def test_a_file_that_is_not_a_results_file_is_refused_and_left_as_it_was(tmp_path, capsys, text):
    out = tmp_path / "q.json"
    out.write_text(text)
    with pytest.raises(SystemExit):
        quality.main(["--only", "dp", "--out", str(out), *TINY])
    assert out.read_text() == text and "not a results file" in capsys.readouterr().err


def test_a_bad_setting_is_refused_before_the_file_is_touched(tmp_path, capsys):
    out = tmp_path / "q.json"
    with pytest.raises(SystemExit):
        quality.main(["--only", "dp", "--out", str(out), *TINY, "--eval-batches", "0"])
    assert "eval_batches" in capsys.readouterr().err and not out.exists()


def test_set_runs_a_named_variant_and_a_bad_setting_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "q.json"
    for bad, says in [("outer_lr=abc", "syncer.outer.lr: must be a number"), ("nope=1", "nope: unknown setting"),
                      ("outer_lr", "'outer_lr' is not NAME=VALUE")]:
        with pytest.raises(SystemExit):
            quality.main(["--only", "decoupled", "--set", bad, "--out", str(out), *TINY])
        assert says in capsys.readouterr().err and not out.exists()
    quality.main(["--only", "decoupled", "--set", "outer_lr=0.3", "--set", "merge=mean", "--out", str(out), *TINY])
    (name, r), = json.loads(out.read_text())["runs"].items()
    assert name == 'decoupled@outer_lr=0.3,merge="mean"'
    assert r["outer"]["lr"] == 0.3 and r["config"]["syncer"]["merge"] == "mean"


def _seed_file(path, seed, losses):
    header = {"preset": "tiny", "tokens": 2048, "seed": seed}
    quality.write_rows(path, header, {k: {"final_eval_loss": v} for k, v in losses.items()}, list(losses))
    return str(path)


def test_seeds_table_shows_every_seed_its_gap_to_that_seeds_dp_and_a_mean_only_over_every_seed(tmp_path, capsys):
    files = [_seed_file(tmp_path / "b.json", 1, {"dp": 2.0, "decoupled": 2.1}),
             _seed_file(tmp_path / "a.json", 0, {"dp": 1.0, "decoupled": 1.01, "decoupled_m8": 1.5})]
    assert quality.main(["--seeds-table", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | seed 0 | seed 1 | mean |"  # columns by seed, whatever the files' order
    assert lines[2] == "| dp | 1.0000 | 2.0000 | 1.5000 |"
    # The mean gap is the mean of each seed's gap to its own dp (+1 % and +5 %), not the gap of the means.
    assert lines[3] == "| decoupled | 1.0100 (+1.0 %) | 2.1000 (+5.0 %) | 1.5550 (+3.00 %) |"
    assert lines[4] == "| decoupled_m8 | 1.5000 (+50.0 %) | – |  |"


def test_seeds_table_refuses_two_files_of_one_seed(tmp_path, capsys):
    files = [_seed_file(tmp_path / f"{n}.json", 0, {"dp": 1.0}) for n in "ab"]
    with pytest.raises(SystemExit):
        quality.main(["--seeds-table", *files])
    assert "same seed" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_benchmark_end_to_end_writes_both_rows(tmp_path):
    """``--quick --only`` two rows in real worker processes, as a user runs it.

    About 3 min of CPU; 9 min of wall time on 2 loaded cores."""
    out = tmp_path / "q.json"
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-m", "bench.quality", "--quick", "--only", "dp", "decoupled_int4_ef",
                    "--jobs", "2", "--out", str(out)], cwd=root, check=True, timeout=900,
                   env={**os.environ, "PYTHONPATH": str(root)})
    doc = json.loads(out.read_text())
    assert doc["quick"] and doc["tokens"] == 250_000 and doc["deployment"]["step_noise"] == 0.1
    assert list(doc["runs"]) == ["dp", "decoupled_int4_ef"]
    for name, r in doc["runs"].items():
        _check_row(name, r)
