"""#23: the chaos harness's two faults of the checkpoint disk and of the operator: ``disk_full`` (the syncer's
writes fail for a while; the run goes on, loudly, and writes again once space returns) and
``restart_syncer_fresh`` (a restart without --resume is refused, then the --resume restart resumes at the
next epoch). Their parsing and validation, the report's checks on made-up records, the hook reaching only
the syncers of a schedule that asks for it; and one real run with both."""
import json

import pytest

from wan_diloco import spec as rt
from wan_diloco.checkpoint.format import FAULT_ENV
from wan_diloco.config import ConfigError
from wan_diloco.runtime import chaos
from wan_diloco.runtime.chaos.processes import ChaosCluster, disk_flag_path

from .conftest import micro_config


# ---- schedules ----------------------------------------------------------------------------------

def test_both_faults_parse_with_their_duration_keys_and_hit_the_syncer():
    faults = chaos.parse_schedule([
        {"t_s": 20, "kind": "restart_syncer_fresh", "down_s": 1},
        {"t_s": 5, "kind": "disk_full", "target": "syncer", "duration_s": 60},
        {"t_s": 30, "kind": "disk_full"},
    ], "s", learners=2)
    assert [(f.t_s, f.kind, f.target, f.hold_s) for f in faults] == [
        (5.0, "disk_full", "syncer", 60.0), (20.0, "restart_syncer_fresh", "syncer", 1.0),
        (30.0, "disk_full", "syncer", chaos.DEFAULT_HOLD_S)]
    assert faults[0].to_dict() == {"t_s": 5.0, "kind": "disk_full", "target": "syncer", "duration_s": 60.0}
    assert faults[1].to_dict()["down_s"] == 1.0
    assert chaos.parse_schedule([f.to_dict() for f in faults], "again", learners=2) == faults


@pytest.mark.parametrize("entry, match", [
    ({"t_s": 1, "kind": "disk_full", "target": "learner-0"}, r"fault 1\.target: disk_full hits 'syncer', got 'learner-0'"),
    ({"t_s": 1, "kind": "disk_full", "down_s": 60}, r"fault 1\.down_s: disk_full takes 'duration_s', not 'down_s'"),
    ({"t_s": 1, "kind": "disk_full", "duration_s": -1}, r"fault 1\.duration_s: must be .*>= 0, got -1"),
    ({"t_s": 1, "kind": "restart_syncer_fresh", "target": "learner-1"},
     r"fault 1\.target: restart_syncer_fresh hits 'syncer'"),
    ({"t_s": 1, "kind": "restart_syncer_fresh", "duration_s": 2},
     r"fault 1\.duration_s: restart_syncer_fresh takes 'down_s'"),
    ({"t_s": 1, "kind": "fill_disk"}, r"fault 1\.kind: unknown kind 'fill_disk'; kinds are .*disk_full, restart_syncer_fresh"),
])
def test_a_bad_entry_of_the_new_kinds_is_refused_in_one_line_naming_it(entry, match):
    with pytest.raises(ConfigError, match=match) as exc:
        chaos.parse_schedule([{"t_s": 0, "kind": "disk_full"}, entry], "sched", learners=2)
    assert "\n" not in str(exc.value)


def test_both_faults_need_snapshots(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2, extra="\n[checkpoint]\nevery_merges = 0\n"))
    with pytest.raises(ConfigError, match="checkpoint.every_merges: disk_full fails the snapshot writes"):
        chaos.check_schedule(cfg, [chaos.Fault(1.0, "disk_full", "syncer", 60.0)])
    with pytest.raises(ConfigError, match="checkpoint.every_merges: restart_syncer_fresh is refused over snapshots"):
        chaos.check_schedule(cfg, [chaos.Fault(1.0, "restart_syncer_fresh", "syncer")])


def test_the_disk_full_hook_reaches_the_syncers_only_and_only_when_asked(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2))
    flag = disk_flag_path(tmp_path)
    hooked = ChaosCluster(cfg, tmp_path / "c.toml", tmp_path, token="t" * 24, syncer_env={FAULT_ENV: str(flag)})
    assert hooked._env_of("syncer")[FAULT_ENV] == str(flag)
    assert FAULT_ENV not in hooked._env_of("learner-0") and FAULT_ENV not in hooked._env_of("learner-1")
    plain = ChaosCluster(cfg, tmp_path / "c.toml", tmp_path, token="t" * 24)
    assert FAULT_ENV not in plain._env_of("syncer")


# ---- the report's checks on made-up runs --------------------------------------------------------

def _record(events: list[dict], faults: list[dict], procs: list[dict] | None = None) -> chaos.RunRecord:
    procs = procs or [{"name": "syncer", "pid": 1, "spawn_t": -5.0, "exit_t": 100.0, "exit_code": 0, "killed": False}]
    return chaos.RunRecord(t0=0.0, t_end=100.0, learners=1, steps=100, events=sorted(events, key=lambda e: e["t"]),
                           procs=procs, faults=faults)


def _storage(ok: bool, failures: int) -> dict:
    return {"dir": "/ckpt", "ok": ok, "failures": failures, "last_error": None if not failures else
            "snapshot 3: could not write the syncer's part: [Errno 28] No space left on device", "free_bytes": 1}


def disk_full_run(space_returns: bool = True, final_written: bool = True) -> chaos.RunRecord:
    """The disk full from 10 s to 40 s: the syncer's snapshots at 15 s and 25 s fail, the one at 45 s completes."""
    ev = [{"source": "syncer", "pid": 1, "t": -1.0, "event": "listening", "epoch": 1, "resumed": None},
          {"source": "syncer", "pid": 1, "t": 5.0, "event": "snapshot", "snapshot": 1}]
    failures = 0
    for t in range(1, 100):
        if t in (15, 25) or (not space_returns and t % 10 == 5 and t > 10):
            failures += 1
            ev.append({"source": "syncer", "pid": 1, "t": t + 0.1, "event": "warning", "storage": _storage(False, failures),
                       "what": "snapshot: could not write the syncer's part: [Errno 28] No space left on device"})
        elif t % 10 == 5 and t > 10:
            ev.append({"source": "syncer", "pid": 1, "t": t + 0.2, "event": "snapshot", "snapshot": t // 10 + 1})
        ok = failures == 0 or (space_returns and t >= 46)
        ev.append({"source": "syncer", "pid": 1, "t": float(t), "event": "progress", "versions": [t, t],
                   "storage": _storage(ok, failures)})
    ev.append({"source": "syncer", "pid": 1, "t": 99.0, "event": "final", "params_path": "/ckpt/params.safetensors"
               if final_written else None, "params_error": None if final_written else "could not write"})
    fault = {"t_s": 10.0, "kind": "disk_full", "target": "syncer", "duration_s": 30.0, "fired_t": 10.0,
             "undone_t": 40.0 if space_returns else None, "skipped": None, "pid": None}
    return _record(ev, [fault])


def test_a_disk_full_window_is_checked_loud_then_written_again():
    rep = chaos.analyze(disk_full_run())
    (fault,) = rep["faults"]
    assert fault["check"] == {"write_failures": 2, "storage_not_ok_seen": True, "storage_ok_again_s": 6.0,
                              "snapshot_after_s": 5.2, "final_params_written": True, "ok": True}
    assert fault["recovered_s"] == pytest.approx(35.2)  # fired at 10 s, the snapshot at 45.2 s
    assert rep["notes"]["targets"]["every_fault_recovered"]
    json.dumps(rep)


def test_a_disk_that_never_frees_or_lost_final_weights_fail_the_check():
    never = chaos.analyze(disk_full_run(space_returns=False))["faults"][0]
    assert never["recovered_s"] is None and never["check"]["snapshot_after_s"] is None
    assert never["check"]["storage_ok_again_s"] is None and not never["check"]["ok"]
    lost = chaos.analyze(disk_full_run(final_written=False))
    assert lost["faults"][0]["check"]["final_params_written"] is False and not lost["faults"][0]["check"]["ok"]
    assert lost["faults"][0]["recovered_s"] is not None  # snapshots came back; the lost weights fail the target
    assert not lost["notes"]["targets"]["every_fault_recovered"]


REFUSAL = ("wan-diloco syncer: refusing to start: /r/checkpoints holds 2 snapshot(s) (2 complete, newest 2) of an "
           "earlier start; starting afresh would fork the run: resume it with --resume")


def fresh_restart_run(exit_code: int | None = 2, line: str = REFUSAL, epoch_after: int = 3) -> chaos.RunRecord:
    """A syncer at epoch 2 killed at 20 s; the start without --resume (pid 2) exits at 23 s; the --resume start
    (pid 3) listens at 30 s and merges at 31 s."""
    ev = [{"source": "syncer", "pid": 1, "t": -1.0, "event": "listening", "epoch": 2, "resumed": {"snapshot": 1}},
          {"source": "syncer", "pid": 1, "t": 10.0, "event": "progress", "versions": [5, 5]},
          {"source": "syncer", "pid": 3, "t": 30.0, "event": "listening", "epoch": epoch_after,
           "resumed": {"snapshot": 2, "versions": [4, 4], "global_step": 40}},
          {"source": "syncer", "pid": 3, "t": 31.0, "event": "progress", "versions": [5, 4]}]
    procs = [{"name": "syncer", "pid": 1, "spawn_t": -5.0, "exit_t": 20.0, "exit_code": -9, "killed": True},
             {"name": "syncer", "pid": 2, "spawn_t": 21.0, "exit_t": 23.0, "exit_code": exit_code, "killed": False,
              "refused": True},
             {"name": "syncer", "pid": 3, "spawn_t": 23.0, "exit_t": 100.0, "exit_code": 0, "killed": False}]
    fault = {"t_s": 20.0, "kind": "restart_syncer_fresh", "target": "syncer", "down_s": 1.0, "fired_t": 20.0,
             "undone_t": 23.0, "skipped": None, "pid": 1,
             "refusal": {"exit_code": exit_code, "line": line, "pid": 2, "t": 23.0}}
    return _record(ev, [fault], procs)


def test_a_fresh_restart_is_checked_refused_then_resumed_at_the_next_epoch():
    rep = chaos.analyze(fresh_restart_run())
    (fault,) = rep["faults"]
    assert fault["check"] == {"refused": True, "refusal_exit_code": 2, "refusal_line": REFUSAL, "epoch_before": 2,
                              "epoch_after": 3, "resumed_snapshot": 2, "resumed_at_next_epoch": True, "ok": True}
    assert fault["recovered_s"] == 11.0 and rep["syncer_resumes"] == 2
    assert rep["notes"]["targets"]["every_fault_recovered"]


@pytest.mark.parametrize("kw, failed", [
    ({"exit_code": 1, "line": "Traceback (most recent call last):"}, "refused"),  # crashed is not refused
    ({"exit_code": None, "line": None}, "refused"),  # it listened: the run forked
    ({"epoch_after": 2}, "resumed_at_next_epoch"),  # the same epoch again: not a resume past the kill
])
def test_a_fresh_restart_that_was_not_refused_or_not_resumed_fails_the_check(kw, failed):
    rep = chaos.analyze(fresh_restart_run(**kw))
    (fault,) = rep["faults"]
    assert fault["check"][failed] is False and not fault["check"]["ok"]
    assert fault["recovered_s"] is None and not rep["notes"]["targets"]["every_fault_recovered"]


def test_the_timeline_draws_both_faults_and_the_refused_start(tmp_path):
    rec = fresh_restart_run()
    both = chaos.RunRecord(**{**rec.__dict__, "faults": rec.faults + disk_full_run().faults})
    chaos.plot_timeline(both, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


# ---- one real run -------------------------------------------------------------------------------

@pytest.mark.slow  # ~75 s; `python -m bench.chaos --quick` runs both faults too
def test_a_real_run_through_a_full_disk_and_a_fresh_restart_finishes_with_its_weights(tmp_path):
    # 400 steps paced to 0.1 s (~40 s of training): the disk is full from 2 s to 8 s (snapshots every 4
    # merges fail meanwhile), then the syncer is killed at 18 s and its supervisor first forgets --resume.
    extra = "\n[checkpoint]\nevery_merges = 4\nkeep = 2\n"
    cfg = rt.load(micro_config(tmp_path, learners=2, steps=400, min_step_s=0.1, extra=extra))
    # Running learners retry an absent syncer this long: more than a refused start plus a resume take.
    cfg = cfg.with_changes(transport={"retry_budget_s": 60.0})
    faults = chaos.parse_schedule([
        {"t_s": 2.0, "kind": "disk_full", "duration_s": 6.0},
        {"t_s": 18.0, "kind": "restart_syncer_fresh", "down_s": 0.5},
    ], "test", learners=2)
    notes = []
    report, record, _ = chaos.run_with_baseline(cfg, faults, tmp_path / "runs", chaos.ChaosOptions(timeout_s=200),
                                                baseline=False, note=notes.append)
    assert record.error is None and report["notes"]["finished"], (record.error, notes)
    disk, fresh = report["faults"]
    assert disk["check"]["write_failures"] >= 1 and disk["check"]["storage_not_ok_seen"], (disk, notes)
    assert disk["check"]["storage_ok_again_s"] is not None and disk["check"]["snapshot_after_s"] is not None, disk
    assert disk["check"]["final_params_written"] and disk["check"]["ok"] and disk["recovered_s"] is not None
    check = fresh["check"]
    assert check["refused"] and check["refusal_exit_code"] == 2 and "refusing to start" in check["refusal_line"], check
    assert "--resume" in check["refusal_line"] and check["epoch_after"] == check["epoch_before"] + 1 == 2, check
    assert check["ok"] and fresh["recovered_s"] is not None and report["syncer_resumes"] == 1
    assert report["notes"]["targets"]["every_fault_recovered"]
    run = tmp_path / "runs" / "chaos"
    assert (run / "checkpoints" / "params.safetensors").exists() and not disk_flag_path(run).exists()
    syncers = record.generations("syncer")
    assert [p["exit_code"] for p in syncers] == [-9, 2, 0] and syncers[1].get("refused")
    assert all(p["exit_code"] == 0 for m in range(2) for p in record.generations(f"learner-{m}")), record.procs
    warnings = [e for e in record.events_of("syncer", "warning") if "[Errno 28]" in e.get("what", "")]
    assert warnings and all(disk["t_s"] <= e["t"] - record.t0 for e in warnings)


def test_the_cli_table_says_whether_each_check_passed(capsys):
    from wan_diloco.cli.chaos import print_report

    print_report(chaos.analyze(disk_full_run()))
    assert "35.2 s; check ok" in capsys.readouterr().out
    print_report(chaos.analyze(fresh_restart_run(exit_code=1, line="Traceback")))
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the table may wrap the cell
    assert "never / skipped; CHECK FAILED (refused)" in text
