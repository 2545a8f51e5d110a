"""`wan-diloco chaos --config F --schedule S`: a real run under a fault schedule, against a fault-free twin.

Faults (``runtime.chaos``): kill_learner, stop_learner, kill_syncer, cut_link
(only with --emulate), disk_full (the syncer's checkpoint writes fail for
duration_s), restart_syncer_fresh (a restart without --resume, which must be
refused, then with --resume). The schedule comes from a file (JSON list or
TOML [[fault]] entries), a failure tape of `wan-diloco goodput --tape` (times
x --tape-scale, tape learners mapped onto this run's), or --kill-every /
--syncer-kill-at; they add up. Fault times count from when every learner has
started training. Writes the report as JSON and a timeline PNG; the exit code
is 0 when the run finished, 1 when it did not.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.table import Table

from wan_diloco import spec as spec_lib
from wan_diloco.cli.report import console, human_bytes, out
from wan_diloco.config import ConfigError, require
from wan_diloco.tape import load_tape
from wan_diloco.runtime import chaos


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: the embedded local default)")
    p.add_argument("--schedule", metavar="FILE", help="faults: a JSON list or TOML [[fault]] entries")
    p.add_argument("--tape", metavar="JSON", help="learner kills from a failure tape (`wan-diloco goodput --tape`)")
    p.add_argument("--tape-scale", type=float, default=None, metavar="X",
                   help="tape seconds x X = seconds of this run (default 1)")
    p.add_argument("--kill-every", type=float, metavar="S", help="kill a learner every S seconds, round-robin")
    p.add_argument("--syncer-kill-at", type=float, metavar="S", help="kill the syncer (and resume it) at S seconds")
    p.add_argument("--down", type=float, default=chaos.DEFAULT_HOLD_S, metavar="S",
                   help=f"with --kill-every/--syncer-kill-at: restart after S seconds (default {chaos.DEFAULT_HOLD_S:g})")
    p.add_argument("--until", type=float, metavar="S",
                   help="generated and tape faults only before S seconds (default: 80%% of steps x run.min_step_s)")
    p.add_argument("--run-dir", metavar="DIR", help="where the runs go (default: run.run_dir/chaos-<time>)")
    p.add_argument("--json", metavar="PATH", help="report as JSON (default: RUN_DIR/chaos.json)")
    p.add_argument("--png", metavar="PATH", help="timeline plot (default: RUN_DIR/chaos.png)")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run of the same config")
    p.add_argument("--emulate", action="store_true", help="run in an emulated WAN (root); needed for cut_link")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="give up on a run after S seconds")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def horizon_s(cfg: spec_lib.RunSpec, until: float | None) -> float | None:
    """Where generated faults stop: --until, else 80 % of the paced training time (room to recover)."""
    if until is not None:
        require(until > 0, "until", f"must be > 0, got {until}")
        return until
    return 0.8 * cfg.run.steps * cfg.run.min_step_s if cfg.run.min_step_s else None


def build_schedule(args: argparse.Namespace, cfg: spec_lib.RunSpec) -> list[chaos.Fault]:
    """Every fault the arguments ask for, validated against the config, sorted by time."""
    M, faults = cfg.run.learners, []
    require(args.tape_scale is None or args.tape, "tape_scale", "only applies with --tape")
    until = horizon_s(cfg, args.until)
    if args.schedule:
        faults += chaos.load_schedule(args.schedule, M, cfg.regions.names)
    if args.tape:
        faults += chaos.from_tape(load_tape(args.tape), 1.0 if args.tape_scale is None else args.tape_scale, M, until)
    if args.kill_every is not None or args.syncer_kill_at is not None:
        require(args.kill_every is None or until is not None, "kill_every",
                "needs --until (or run.min_step_s > 0 to estimate how long training lasts)")
        every = args.kill_every if args.kill_every is not None else float("inf")
        for name in ("kill_every", "syncer_kill_at", "down"):
            value = getattr(args, name)
            require(value is None or value >= 0, name, f"must be >= 0, got {value}")
        faults += chaos.round_robin(M, every, until or 0.0, args.syncer_kill_at, args.down, args.down)
    if not faults:
        raise ConfigError("no faults: give --schedule, --tape or --kill-every / --syncer-kill-at")
    faults.sort(key=lambda f: f.t_s)
    chaos.check_schedule(cfg, faults)
    return faults


def _check_text(check: dict | None) -> str:
    """disk_full / restart_syncer_fresh: whether the fault's own check passed, else what failed."""
    if check is None:
        return ""
    failed = [k for k, v in check.items() if v is False and k != "ok"]
    return "; check ok" if check["ok"] else f"; CHECK FAILED ({', '.join(failed) or 'a figure is missing'})"


def print_report(report: dict) -> None:
    t = Table(title="chaos run")
    for col in ("t_s", "fault", "target", "recovered after"):
        t.add_column(col, justify="right" if col != "fault" else "left")
    for f in report["faults"]:
        rec = f["recovered_s"]
        t.add_row(f"{f['t_s']:.1f}", f["kind"], f["target"],
                  (f"{rec:.1f} s" if rec is not None else "never / skipped") + _check_text(f.get("check")))
    out.print(t)
    s = Table(show_header=False)
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    notes = report["notes"]
    for k, v in [
        ("finished", "yes" if notes["finished"] else f"NO ({notes['error'] or 'a learner did not finish'})"),
        ("uptime (merging)", fmt(report["uptime"], ".3f")), ("uptime (processes alive)", fmt(notes["uptime_alive"], ".3f")),
        ("goodput", fmt(report["goodput"], ".3f")), ("recovery bytes", human_bytes(report["recovery_bytes"])),
        ("final eval loss (fault-free)", f"{fmt(report['final_eval_loss'], '.4f')} ({fmt(report['fault_free_eval_loss'], '.4f')})"),
        ("loss ratio", fmt(report["loss_ratio"], ".4f")), ("syncer resumes", str(report["syncer_resumes"])),
        ("mean snapshot interval", f"{fmt(report['snapshot_interval_s'], '.1f')} s"),
        ("training lost (learner-seconds)", fmt(report["lost_s"], ".1f")), ("wall time", f"{notes['wall_s']:.1f} s"),
    ]:
        s.add_row(k, v)
    out.print(s)
    for line in notes["skipped"]:
        console.print(f"skipped: {line}")


def run(args: argparse.Namespace) -> int:
    cfg = spec_lib.load(args.config)
    faults = build_schedule(args, cfg)  # refuse a bad schedule before any process starts
    rdir = Path(args.run_dir) if args.run_dir else Path(cfg.run.run_dir) / time.strftime("chaos-%Y%m%d-%H%M%S")
    json_path = Path(args.json) if args.json else rdir / "chaos.json"
    png_path = Path(args.png) if args.png else rdir / "chaos.png"
    note = (lambda s: None) if args.quiet else (lambda s: console.print(s, highlight=False))
    options = chaos.ChaosOptions(timeout_s=args.timeout, emulate=args.emulate)
    report, _, _ = chaos.run_with_baseline(cfg, faults, rdir, options, baseline=not args.no_baseline, note=note,
                                           png=png_path)
    chaos.write_report(report, json_path)
    print_report(report)
    console.print(f"report: {json_path}   timeline: {png_path}   runs: {rdir}")
    return 0 if report["notes"]["finished"] else 1
