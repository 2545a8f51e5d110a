"""The chaos harness (#13): schedules (files, generator, failure tapes) and their validation, the report's
figures on a made-up record, the CLI's refusals; and one short real run with a learner kill, a syncer
kill + resume and a cut link (skipped on loopback)."""
import json

import pytest

from wan_diloco import spec as rt
from wan_diloco.cli import main
from wan_diloco.config import ConfigError
from wan_diloco.planning.tape import Outage, save_tape
from wan_diloco.runtime import chaos

from .conftest import micro_config

SCHEMA = {"faults", "uptime", "goodput", "recovery_bytes", "final_eval_loss", "fault_free_eval_loss", "loss_ratio",
          "syncer_resumes", "snapshot_interval_s", "lost_s"}


# ---- schedules ----------------------------------------------------------------------------------

def test_a_json_schedule_is_parsed_sorted_with_default_durations():
    faults = chaos.parse_schedule([
        {"t_s": 30, "kind": "kill_syncer", "down_s": 2},
        {"t_s": 10, "kind": "kill_learner", "target": "learner-1"},
        {"t_s": 20, "kind": "stop_learner", "target": "learner-0", "duration_s": 3.5},
        {"t_s": 25, "kind": "cut_link", "target": "eu-west"},
    ], "s", learners=2, regions=("us-east", "eu-west"))
    assert [(f.t_s, f.kind, f.target, f.hold_s) for f in faults] == [
        (10.0, "kill_learner", "learner-1", 5.0), (20.0, "stop_learner", "learner-0", 3.5),
        (25.0, "cut_link", "eu-west", 5.0), (30.0, "kill_syncer", "syncer", 2.0)]
    assert faults[0].to_dict() == {"t_s": 10.0, "kind": "kill_learner", "target": "learner-1", "down_s": 5.0}
    assert faults[1].to_dict()["duration_s"] == 3.5


def test_a_toml_schedule_file_has_fault_entries(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[fault]]\nt_s = 5\nkind = "kill_learner"\ntarget = "learner-0"\ndown_s = 1\n\n'
                    '[[fault]]\nt_s = 2.5\nkind = "kill_syncer"\ntarget = "syncer"\n')
    faults = chaos.load_schedule(path, learners=2)
    assert [(f.t_s, f.kind, f.hold_s) for f in faults] == [(2.5, "kill_syncer", 5.0), (5.0, "kill_learner", 1.0)]
    js = tmp_path / "s.json"
    js.write_text(json.dumps([f.to_dict() for f in faults]))
    assert chaos.load_schedule(js, learners=2) == faults  # what to_dict writes reads back


@pytest.mark.parametrize("entry, match", [
    ({"t_s": 1, "kind": "explode", "target": "learner-0"}, r"fault 1\.kind: unknown kind 'explode'"),
    ({"t_s": -1, "kind": "kill_learner", "target": "learner-0"}, r"fault 1\.t_s: must be .*>= 0, got -1"),
    ({"t_s": 1, "kind": "kill_learner", "target": "learner-2"}, r"fault 1\.target: unknown target 'learner-2'.*learner-1"),
    ({"t_s": 1, "kind": "kill_learner"}, r"fault 1\.target: kill_learner needs a target"),
    ({"t_s": 1, "kind": "kill_syncer", "target": "learner-0"}, r"fault 1\.target: kill_syncer hits 'syncer'"),
    ({"t_s": 1, "kind": "cut_link", "target": "mars"}, r"fault 1\.target: unknown target 'mars'.*region"),
    ({"t_s": 1, "kind": "stop_learner", "target": "learner-0", "down_s": 2}, r"fault 1\.down_s: stop_learner takes 'duration_s'"),
    ({"t_s": 1, "kind": "kill_learner", "target": "learner-0", "when": 2}, r"fault 1: unknown key 'when'"),
    ({"kind": "kill_learner", "target": "learner-0"}, r"fault 1: missing key 't_s'"),
    ({"t_s": "soon", "kind": "kill_learner", "target": "learner-0"}, r"fault 1\.t_s"),
    ({"t_s": 1, "kind": "kill_learner", "target": "learner-0", "down_s": float("nan")}, r"fault 1\.down_s"),
    ("kill", r"fault 1: must be an object"),
])
def test_a_bad_entry_is_refused_naming_it(entry, match):
    good = {"t_s": 0, "kind": "kill_learner", "target": "learner-0"}
    with pytest.raises(ConfigError, match=match):
        chaos.parse_schedule([good, entry], "sched", learners=2, regions=("us-east", "eu-west"))


def test_bad_schedule_files_are_refused_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        chaos.load_schedule(tmp_path / "nope.json", 2)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ConfigError, match=r"bad\.json: invalid JSON"):
        chaos.load_schedule(bad, 2)
    obj = tmp_path / "obj.json"
    obj.write_text('{"faults": []}')
    with pytest.raises(ConfigError, match="unknown table 'faults'"):
        chaos.load_schedule(obj, 2)
    toml = tmp_path / "bad.toml"
    toml.write_text("[[fault]\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        chaos.load_schedule(toml, 2)


def test_round_robin_kills_each_learner_in_turn_plus_one_syncer_kill():
    faults = chaos.round_robin(learners=3, every_s=60, until_s=300, syncer_at_s=150, down_s=4, syncer_down_s=2)
    kills = [(f.t_s, f.target) for f in faults if f.kind == "kill_learner"]
    assert kills == [(60, "learner-0"), (120, "learner-1"), (180, "learner-2"), (240, "learner-0")]
    assert [(f.t_s, f.hold_s) for f in faults if f.kind == "kill_syncer"] == [(150, 2)]
    assert [f.t_s for f in faults] == sorted(f.t_s for f in faults)
    with pytest.raises(ConfigError, match="every_s > 0"):
        chaos.round_robin(2, 0, 100)


def test_a_tape_is_scaled_in_time_mapped_onto_the_runs_learners_and_merged():
    tape = [Outage(0, 100.0, 200.0), Outage(5, 150.0, 400.0), Outage(1, 1000.0, 1100.0), Outage(3, 5000.0, 5100.0)]
    faults = chaos.from_tape(tape, scale=0.1, learners=2, horizon_s=300)
    # learner 5 -> 1, 3 -> 1; 0's [10, 20) stays; 1's [15, 40) and [100, 110); 1's [500, 510) is past the horizon.
    assert [(f.t_s, f.target, f.hold_s) for f in faults] == [
        (10.0, "learner-0", 10.0), (15.0, "learner-1", 25.0), (100.0, "learner-1", 10.0)]
    tape2 = [Outage(0, 10.0, 20.0), Outage(2, 15.0, 30.0)]  # 2 -> 0 overlaps: one outage [10, 30)
    assert [(f.t_s, f.hold_s) for f in chaos.from_tape(tape2, 1.0, 2)] == [(10.0, 20.0)]
    with pytest.raises(ConfigError, match="tape scale"):
        chaos.from_tape(tape, 0.0, 2)


def test_a_syncer_kill_needs_snapshots(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2, extra="\n[checkpoint]\nevery_merges = 0\n"))
    with pytest.raises(ConfigError, match="every_merges"):
        chaos.check_schedule(cfg, [chaos.Fault(1.0, "kill_syncer", "syncer")])
    chaos.check_schedule(cfg, [chaos.Fault(1.0, "kill_learner", "learner-1")])


# ---- the report on a made-up run ----------------------------------------------------------------

def made_up_record() -> chaos.RunRecord:
    """Two learners, 0.1 s steps, t0 = 1000: learner-1 killed at 10 s (back stepping at 17 s); the syncer
    killed at 20 s, resumed from a snapshot at step 150 (listening at 24 s, merging again at 25 s);
    the learners rejoin at steps 240 and 243."""
    t0, ev = 1000.0, []
    add = lambda t, src, pid, kind, **kw: ev.append({"source": src, "t": t0 + t, "pid": pid, "event": kind, **kw})  # noqa: E731
    add(-5, "syncer", 1, "listening", resumed=None)
    add(0, "learner-0", 10, "start", region="a", step=0, bytes_received=1000)
    add(0, "learner-1", 11, "start", region="b", step=0, bytes_received=1000)
    version = 0
    for i in range(1, 41):  # merges every 0.5 s until the syncer dies at 20 s
        t = i * 0.5
        version += 1
        add(t, "syncer", 1, "progress", versions=[version, 0], global_step=int(t * 10))
        add(t, "learner-0", 10, "step", step=int(t * 10), versions=[version, 0], bytes_received=1000 + 10 * i)
        if t < 10:
            add(t, "learner-1", 11, "step", step=int(t * 10), versions=[version, 0], bytes_received=1000 + 10 * i)
    add(8, "syncer", 1, "snapshot", snapshot=1)
    add(12, "syncer", 1, "snapshot", snapshot=2)
    add(16, "syncer", 1, "snapshot", snapshot=3)
    add(16.5, "learner-1", 12, "start", region="b", step=165, bytes_received=5000)
    add(17, "learner-1", 12, "step", step=170, versions=[34, 0], bytes_received=5100)
    add(21, "learner-0", 10, "step", step=210, versions=[40, 0], bytes_received=1500)
    add(24, "syncer", 2, "listening", resumed={"snapshot": 3, "versions": [30, 0], "global_step": 150})
    add(24.2, "learner-0", 10, "rejoin", step=240)
    add(24.3, "learner-1", 12, "rejoin", step=243)
    add(24.5, "syncer", 2, "progress", versions=[30, 0], global_step=150)
    for i in range(1, 31):  # merging again from 25 s to 39.5 s
        t = 24.5 + i * 0.5
        add(t, "syncer", 2, "progress", versions=[30 + i, 0], global_step=int(t * 10))
        add(t, "learner-0", 10, "step", step=int(t * 10), versions=[30 + i, 0], bytes_received=3000 + 10 * i)
        add(t, "learner-1", 12, "step", step=int(t * 10), versions=[30 + i, 0], bytes_received=5100 + 10 * i)
    add(40, "learner-0", 10, "finishing", step=400)
    add(40, "learner-1", 12, "finishing", step=400)
    add(41, "syncer", 2, "final")
    add(41, "learner-0", 10, "final", final_eval_loss=2.0, compute_s=40.0, train_s=40.0, tokens=4000)
    add(41, "learner-1", 12, "final", final_eval_loss=2.2, compute_s=23.5, train_s=23.5, tokens=2300)
    procs = [{"name": "syncer", "pid": 1, "spawn_t": t0 - 8, "exit_t": t0 + 20, "exit_code": -9, "killed": True},
             {"name": "learner-0", "pid": 10, "spawn_t": t0 - 6, "exit_t": t0 + 41.5, "exit_code": 0, "killed": False},
             {"name": "learner-1", "pid": 11, "spawn_t": t0 - 6, "exit_t": t0 + 10, "exit_code": -9, "killed": True},
             {"name": "learner-1", "pid": 12, "spawn_t": t0 + 11, "exit_t": t0 + 41.5, "exit_code": 0, "killed": False},
             {"name": "syncer", "pid": 2, "spawn_t": t0 + 21, "exit_t": t0 + 41.2, "exit_code": 0, "killed": False}]
    faults = [{"t_s": 10.0, "kind": "kill_learner", "target": "learner-1", "down_s": 1.0, "fired_t": t0 + 10,
               "undone_t": t0 + 11, "skipped": None, "pid": 11},
              {"t_s": 20.0, "kind": "kill_syncer", "target": "syncer", "down_s": 1.0, "fired_t": t0 + 20,
               "undone_t": t0 + 21, "skipped": None, "pid": 1},
              {"t_s": 30.0, "kind": "cut_link", "target": "b", "duration_s": 5.0, "fired_t": t0 + 30,
               "undone_t": None, "skipped": "cut_link needs the emulated WAN", "pid": None}]
    ev.sort(key=lambda e: e["t"])
    return chaos.RunRecord(t0=t0, t_end=t0 + 41.5, learners=2, steps=400, events=ev, procs=procs, faults=faults)


def test_the_report_of_a_made_up_run():
    rec = made_up_record()
    rep = chaos.analyze(chaos.RunRecord.from_json(rec.to_json()), baseline=rec)
    assert SCHEMA <= set(rep) and set(rep) - SCHEMA == {"notes"}
    assert [f["recovered_s"] for f in rep["faults"]] == [7.0, 5.0, None]
    assert all(set(f) == {"t_s", "kind", "target", "recovered_s"} for f in rep["faults"])
    # Merging from 0.5 s to 40 s, except the gap 20 s -> 25 s (longer than the 3 s window).
    assert rep["uptime"] == pytest.approx(1 - 5.0 / 39.5, abs=1e-3)
    # Compute: learner-0 40 s, learner-1 9.5 s (killed) + 23.5 s; supposed: 40 s each.
    assert rep["goodput"] == pytest.approx((40 + 9.5 + 23.5) / 80, abs=1e-3)
    # The restart's join (5000) and the rejoins: learner-0 3010 at 25 s minus 1500 before, learner-1 5110 - 5100.
    assert rep["recovery_bytes"] == 5000 + 1510 + 10
    assert rep["syncer_resumes"] == 1 and rep["snapshot_interval_s"] == pytest.approx(4.0)
    # learner-1 down 7 s + (240 - 150) + (243 - 150) rolled-back steps x 0.1 s.
    assert rep["notes"]["rolled_back_steps"] == 183 and rep["notes"]["step_s"] == pytest.approx(0.1, rel=0.01)
    assert rep["lost_s"] == pytest.approx(7.0 + 18.3, rel=0.01)
    assert rep["final_eval_loss"] == pytest.approx(2.1) and rep["loss_ratio"] == pytest.approx(1.0)
    assert rep["notes"]["finished"] and len(rep["notes"]["skipped"]) == 1
    assert rep["notes"]["targets"]["every_fault_recovered"]  # the skipped cut is not counted
    assert not rep["notes"]["targets"]["uptime>=0.9"]
    json.dumps(rep)


def test_a_learner_killed_before_it_rejoined_still_loses_its_steps_since_the_snapshot_and_tokens_add_up():
    ev = [{"source": "syncer", "pid": 1, "t": -5.0, "event": "listening", "resumed": None}]
    ev += [{"source": "learner-0", "pid": 10, "t": float(t), "event": "step", "step": 10 * t, "tokens": 100 * t}
           for t in range(1, 8)]
    ev += [{"source": "syncer", "pid": 2, "t": 8.0, "event": "listening",
            "resumed": {"snapshot": 1, "versions": [2, 2], "global_step": 20}},
           # Restarted from its snapshot part (5000 tokens then): 3 steps of its own.
           {"source": "learner-0", "pid": 11, "t": 12.0, "event": "step", "step": 80, "tokens": 5100},
           {"source": "learner-0", "pid": 11, "t": 15.0, "event": "final", "tokens": 5300}]
    procs = [{"name": "syncer", "pid": 1, "spawn_t": -6.0, "exit_t": 5.0, "exit_code": -9, "killed": True},
             {"name": "learner-0", "pid": 10, "spawn_t": -5.0, "exit_t": 9.0, "exit_code": -9, "killed": True},
             {"name": "syncer", "pid": 2, "spawn_t": 6.0, "exit_t": 16.0, "exit_code": 0, "killed": False},
             {"name": "learner-0", "pid": 11, "spawn_t": 10.0, "exit_t": 16.0, "exit_code": 0, "killed": False}]
    rec = chaos.RunRecord(t0=0.0, t_end=16.0, learners=1, steps=100, events=ev, procs=procs, faults=[],
                          tokens_per_step=100)
    assert chaos.rolled_back_steps(rec) == 70 - 20  # its last report before the kill, not merged into anything
    # A learner restarted during the outage that joins the resumed syncer directly, killed later: nothing lost.
    late = {"name": "learner-0", "pid": 12, "spawn_t": 7.0, "exit_t": 14.0, "exit_code": -9, "killed": True}
    steps = [{"source": "learner-0", "pid": 12, "t": 9.0 + i, "event": "step", "step": 25 + i} for i in range(4)]
    rec2 = chaos.RunRecord(t0=0.0, t_end=16.0, learners=1, steps=100, events=sorted(ev + steps, key=lambda e: e["t"]),
                           procs=procs + [late], faults=[])
    assert chaos.rolled_back_steps(rec2) == 70 - 20
    assert chaos.tokens_trained(rec) == (700 - 100 + 100) + (5300 - 5100 + 100)


def test_the_timeline_png(tmp_path):
    rec = made_up_record()
    chaos.plot_timeline(rec, tmp_path / "t.png", baseline=rec)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


# ---- the CLI refuses bad input before starting anything -----------------------------------------

def cli_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["chaos", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err.strip()


def test_the_cli_refuses_bad_schedules_in_one_line(tmp_path, capsys):
    cfg = micro_config(tmp_path, learners=2, steps=100, min_step_s=0.1)
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps([{"t_s": 1, "kind": "kill_learner", "target": "learner-9"}]))
    err = cli_error(capsys, "--config", str(cfg), "--schedule", str(bad))
    assert "fault 0.target: unknown target 'learner-9'" in err and len(err.splitlines()) == 1
    assert "no faults" in cli_error(capsys, "--config", str(cfg))
    assert "only applies with --tape" in cli_error(capsys, "--config", str(cfg), "--kill-every", "5", "--tape-scale", "2")
    tape = tmp_path / "tape.json"
    save_tape(tape, [Outage(3, 0.0, 1.0)])
    assert "tape scale" in cli_error(capsys, "--config", str(cfg), "--tape", str(tape), "--tape-scale", "-1")
    nosnap = micro_config(tmp_path, learners=2, steps=100, min_step_s=0.1, extra="\n[checkpoint]\nevery_merges = 0\n")
    assert "every_merges" in cli_error(capsys, "--config", str(nosnap), "--syncer-kill-at", "3")


def test_the_cli_builds_one_schedule_from_every_source(tmp_path):
    from wan_diloco.cli import build_parser
    from wan_diloco.cli.chaos import build_schedule

    cfg_path = micro_config(tmp_path, learners=2, steps=100, min_step_s=0.1)  # 10 s paced: faults before 8 s
    sched = tmp_path / "s.json"
    sched.write_text(json.dumps([{"t_s": 1, "kind": "stop_learner", "target": "learner-0", "duration_s": 2}]))
    tape = tmp_path / "tape.json"
    save_tape(tape, [Outage(3, 20.0, 30.0), Outage(0, 1000.0, 1010.0)])
    args = build_parser().parse_args(["chaos", "--config", str(cfg_path), "--schedule", str(sched), "--tape", str(tape),
                                      "--tape-scale", "0.1", "--kill-every", "3", "--syncer-kill-at", "4", "--down", "1"])
    faults = build_schedule(args, rt.load(cfg_path))
    assert [(f.t_s, f.kind, f.target) for f in faults] == [
        (1.0, "stop_learner", "learner-0"), (2.0, "kill_learner", "learner-1"), (3.0, "kill_learner", "learner-0"),
        (4.0, "kill_syncer", "syncer"), (6.0, "kill_learner", "learner-1")]


# ---- one real run -------------------------------------------------------------------------------

@pytest.mark.slow  # ~80 s; tests/sim/test_faults.py replays kill + resume, test_resume.py resumes from files by default
def test_a_run_with_a_learner_kill_and_a_syncer_resume_finishes_and_recovers(tmp_path):
    # 400 steps paced to 0.1 s: ~40 s of training, so that a restarted learner (import, compile, join:
    # ~10 s, ~20 s on a loaded machine) and the resumed syncer are back well before the end.
    extra = "\n[checkpoint]\nevery_merges = 4\nkeep = 2\n"
    cfg = rt.load(micro_config(tmp_path, learners=2, steps=400, min_step_s=0.1, extra=extra))
    # Running learners retry an absent syncer this long: more than a resume takes on a loaded machine.
    cfg = cfg.with_changes(transport={"retry_budget_s": 60.0})
    faults = chaos.parse_schedule([
        {"t_s": 1.0, "kind": "kill_learner", "target": "learner-1", "down_s": 0.5},
        {"t_s": 3.0, "kind": "kill_syncer", "down_s": 0.5},
        {"t_s": 4.0, "kind": "cut_link", "target": "learner-0"},  # loopback: skipped, and says so
    ], "test", learners=2, regions=cfg.regions.names)
    notes = []
    report, record, base = chaos.run_with_baseline(cfg, faults, tmp_path / "runs", chaos.ChaosOptions(timeout_s=150),
                                                   baseline=False, note=notes.append, png=tmp_path / "t.png")
    assert base is None and record.error is None, (record.error, notes)
    assert report["notes"]["finished"], notes
    assert SCHEMA <= set(report) and set(report) - SCHEMA == {"notes", "config"}
    kill, resume, cut = report["faults"]
    assert kill["recovered_s"] is not None and resume["recovered_s"] is not None, (report, notes)
    assert cut["recovered_s"] is None and "emulated WAN" in report["notes"]["skipped"][0]
    assert report["syncer_resumes"] == 1 and report["recovery_bytes"] > 0
    assert 0 < report["goodput"] <= 1 and 0 < report["uptime"] <= 1 and report["final_eval_loss"] > 0
    assert report["fault_free_eval_loss"] is None and report["loss_ratio"] is None
    assert (tmp_path / "t.png").exists() and (tmp_path / "runs" / "chaos" / "chaos_record.json").exists()
    assert all(p["exit_t"] is not None for p in record.procs)


def test_the_cli_writes_the_report_and_says_whether_the_run_finished(tmp_path, monkeypatch, capsys):
    rec = made_up_record()
    calls = {}

    def fake_run(cfg, faults, rdir, options, baseline, note, png):
        calls.update(faults=faults, rdir=rdir, baseline=baseline, png=png)
        return {**chaos.analyze(rec, None), "config": chaos.config_summary(cfg)}, rec, None

    monkeypatch.setattr(chaos, "run_with_baseline", fake_run)
    cfg = micro_config(tmp_path, learners=2, steps=100, min_step_s=0.1)
    code = main(["chaos", "--config", str(cfg), "--kill-every", "3", "--no-baseline", "--run-dir", str(tmp_path / "r"),
                 "--quiet"])
    assert code == 0 and calls["baseline"] is False and calls["png"] == tmp_path / "r" / "chaos.png"
    assert [f.target for f in calls["faults"]] == ["learner-0", "learner-1"]  # at 3 s and 6 s, before 8 s
    report = json.loads((tmp_path / "r" / "chaos.json").read_text())
    assert SCHEMA <= set(report) and report["syncer_resumes"] == 1
    assert "kill_syncer" in capsys.readouterr().out


def test_the_fault_free_loss_is_read_at_the_tokens_the_faulty_run_trained():
    # A fault-free run: two learners, 100 tokens a step each, 0.1 s steps, eval points every 100 steps.
    t0, ev = 0.0, []
    for m in (0, 1):
        for step in range(1, 401):
            ev.append({"source": f"learner-{m}", "t": step * 0.1, "pid": 10 + m, "event": "step", "step": step,
                       "tokens": 100 * step})
        ev.append({"source": f"learner-{m}", "t": 40.5, "pid": 10 + m, "event": "final", "final_eval_loss": 2.0,
                   "tokens": 40_000})
    for step, loss in ((100, 4.0), (200, 3.0), (300, 2.5)):
        ev.append({"source": "learner-0", "t": step * 0.1 + 0.01, "pid": 10, "event": "eval", "step": step,
                   "eval_loss": loss})
    procs = [{"name": f"learner-{m}", "pid": 10 + m, "spawn_t": -1, "exit_t": 41, "exit_code": 0, "killed": False}
             for m in (0, 1)]
    base = chaos.RunRecord(t0=t0, t_end=41, learners=2, steps=400, events=ev, procs=procs, faults=[],
                           tokens_per_step=100)
    from wan_diloco.runtime.chaos.report import eval_curve, loss_at_tokens

    curve = eval_curve(base)
    assert curve == [(20_000, 4.0), (40_000, 3.0), (60_000, 2.5), (80_000, 2.0)]  # both learners' tokens by then
    assert loss_at_tokens(curve, 50_000) == 2.75 and loss_at_tokens(curve, 90_000) == 2.0
    assert loss_at_tokens(curve, 10_000) == 4.0 and loss_at_tokens([], 5) is None
    rec = made_up_record()  # a few thousand tokens: before the fault-free run's first point
    report = chaos.analyze(rec, base)
    assert report["fault_free_eval_loss"] == 4.0 and report["notes"]["compared_at"] == "equal tokens"
    assert report["notes"]["fault_free_eval_loss_equal_steps"] == 2.0
    assert report["loss_ratio"] == round(report["final_eval_loss"] / 4.0, 5)
