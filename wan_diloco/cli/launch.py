"""`wan-diloco launch --config F`: a syncer and M learners as local processes, a live table (in a log: a
progress line every few seconds), a summary.

Every JSON event of every process goes to ``RUN_DIR/metrics.jsonl`` (with its
source); each process's stderr to ``RUN_DIR/<name>.log`` (``runtime.launch``).
The exit code is non-zero, with the reason, when the run cannot continue.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from wan_diloco.cli.report import human_bytes, console, out
from wan_diloco import spec as spec_lib
from wan_diloco.cli import plan as plan_cli
from wan_diloco.cli import progress
from wan_diloco.runtime.launch import RunState, last_line, launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (see examples/local.toml)")
    p.add_argument("--resume", metavar="RUN_DIR", type=Path,
                   help="restart a run from the newest complete snapshot in RUN_DIR (its config.toml is used)")
    p.add_argument("--emulate", action="store_true",
                   help="run every process in its region's namespace of an emulated WAN built from [regions] "
                        "(needs root; TLS with a CA made for the run)")
    p.add_argument("--plan", action="store_true",
                   help="plan H, P, tau, bits and the grace cap from the links first (as `wan-diloco plan`), "
                        "print the plan and run with it")
    p.add_argument("--measured", type=Path, metavar="PATH",
                   help="with --plan: a previous run's metrics.jsonl, whose measured links replace [regions]'s")
    p.add_argument("--step-time", type=float, metavar="S", help="with --plan: seconds per step (default: timed here)")
    add_common(p)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", metavar="DIR", help="where metrics.jsonl and logs go (default: run.run_dir/<time>)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--table", dest="view", action="store_const", const="table",
                      help="the live table, also when stdout is not a terminal")
    view.add_argument("--plain", dest="view", action="store_const", const="plain",
                      help="a plain progress line every --progress-every-s and the summary as 'label: value' lines "
                           "(default when stdout is not a terminal: a log file, CI)")
    view.add_argument("--quiet", dest="view", action="store_const", const="quiet",
                      help="no live table and no progress lines")
    progress.add_progress_argument(p)


def view_of(args: argparse.Namespace) -> str:
    """"table", "plain" or "quiet": as asked, else a table in a terminal and plain lines elsewhere."""
    return args.view or ("table" if sys.stdout.isatty() else "plain")


def table(mon: RunState, learners: list[int] | None = None) -> Table:
    """The live table; ``learners``: only these rows (a standalone learner shows its own)."""
    cfg = mon.cfg
    t = Table(title=f"wan-diloco: {cfg.run.learners} learners, step budget {cfg.run.steps}")
    for col in ("process", "region", "step", "loss", "tokens", "sent", "link", "tau", "status"):
        # In a narrow terminal the link and the status wrap; a name or a figure cut to "learne…" says nothing.
        t.add_column(col, justify="left" if col in ("process", "region", "link", "status") else "right",
                     no_wrap=col not in ("link", "status"))
    for m, r in mon.learners.items():
        if learners is not None and m not in learners:
            continue
        loss, link = r.get("loss"), r.get("link")
        t.add_row(f"learner-{m}", r["region"], str(r.get("step", "")), f"{loss:.3f}" if loss is not None else "",
                  f"{r.get('tokens', 0):,}", human_bytes(r.get("bytes_sent", 0)),
                  f"{link['rate_gbit_s']:.3g} Gbit/s {link['rtt_ms']:.0f} ms" if link else "", str(r["tau"]),
                  r["status"])
    for name, s in [("syncer", mon.syncer), *((f"syncer-{k}", v) for k, v in sorted(mon.shards.items()))]:
        versions = s.get("versions", "")
        if mon.cfg.syncer.shards > 1 and "owned" in s and versions:  # a shard: its own fragments only
            versions = f"fragments {','.join(map(str, s['owned']))}: " + str([versions[p] for p in s["owned"]])
        t.add_row(name, "", str(s.get("global_step", "")), "", "", human_bytes(s.get("bytes_out", 0)), "", "",
                  f"versions {versions}")
        failing = storage_failing(s.get("storage"))
        if failing:  # loud: a run that cannot write its snapshots (or its weights) loses them on a crash
            t.add_row(f"{name} disk", "", "", "", "", "", "", "", Text(failing, style="bold red"))
    captions = []
    b = mon.barrier
    if b and not b.get("started"):
        waiting = ", ".join(f"learner-{m}" for m in b.get("waiting_for") or ()) or "?"
        captions.append(f"start barrier: {len(b.get('joined') or ())} of {b.get('need')} learners joined; "
                        f"waiting for {waiting}")
    if mon.evals:
        last = mon.evals[-1]
        captions.append(f"global model: eval loss {last['eval_loss']:.3f} at step {last['step']} (run.eval_every_steps)")
    if captions:
        t.caption = "\n".join(captions)
    return t


def storage_failing(storage: dict | None) -> str | None:
    """The live table's line for a syncer whose writes fail (``/status["storage"]``), else None."""
    if not isinstance(storage, dict) or storage.get("ok", True):
        return None
    free = storage.get("free_bytes")
    return (f"WRITES FAILING ({storage.get('failures', 0)} so far) in {storage.get('dir')}: "
            f"{storage.get('last_error')}; free {human_bytes(free) if free is not None else 'unknown'}")


def print_summary(s: dict) -> None:
    # In a terminal paths below here are shortened; a log is read from anywhere: the whole path.
    path = _short_path if out.is_terminal else (lambda p: p)
    rows = [
        ("eval loss", f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}"),
        ("learners finished", f"{s['learners_finished']} / {s['learners']}" + (
            f" (in the final sync: {len(s['final_learners'])})"
            if len(s.get("final_learners", [])) != s["learners_finished"] else "")),
        ("tokens", f"{s['tokens']:,}"),
        *((f"learner-{m}: steps, tokens", f"{p['steps']:,}, {p['tokens']:,}" + ("" if p["finished"] else
                                                                               f" (not finished: {p['status']})"))
          for m, p in (s.get("per_learner") or {}).items()),
        ("global steps", str(s["global_steps"])),
        ("goodput", f"{s['goodput']:.1%}"),
        ("fragment syncs", " ".join(map(str, s["fragment_syncs"]))),
        ("mean quorum (late Δs carried)", f"{s['mean_quorum']:.2f} ({s['late_carried']})"),
        ("bytes sent (learners <-> syncer)", human_bytes(s["bytes_sent"])),
        ("data parallel, same steps", f"{human_bytes(s['dp_bytes'])} ({s['dp_bytes'] / max(1, s['bytes_sent']):.0f}x more)"),
        ("compression ratio", f"{s['compression_ratio']:.2f}x"),
        ("final fragments bit-identical", "yes" if s["bit_identical"] else "NO"),
        ("snapshots (run id)", f"{s.get('snapshots', 0)} ({s.get('run_id')})"),
        ("final parameters", path(s.get("params_path")) or "not written (checkpoint.dir is empty)"),
        ("loss curve", path(s.get("loss_png")) or "not drawn"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    out.print()
    progress.show_rows("networked run", rows, out)


def _short_path(path: str | None) -> str | None:
    """``path`` relative to here when it is below here (the run folder usually is)."""
    if not path:
        return None
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def launch_and_show(cfg: spec_lib.RunSpec, config_text: str, run_dir: str | None, view: str,
                    emulate: bool = False, resume: bool = False,
                    every_s: float = progress.DEFAULT_EVERY_S) -> tuple[int, dict]:
    """``runtime.launch`` shown as ``view`` ("table", "plain" progress lines on stdout or "quiet"), and its
    warnings and errors printed."""
    if view == "quiet":
        code, summary = launch(cfg, config_text, run_dir, emulate=emulate, resume=resume)
    elif view == "plain":
        code, summary = _launch_plain(cfg, config_text, run_dir, emulate, resume, every_s)
    else:
        with Live(table(RunState(cfg)), console=console, refresh_per_second=4, transient=False) as live:
            code, summary = launch(cfg, config_text, run_dir, watch=lambda mon: live.update(table(mon)),
                                   emulate=emulate, resume=resume)
    for line in summary.get("emulator", {}).get("namespaces", []):
        console.print(f"emulated WAN: {line}")
    for name, (exit_code, log) in summary.get("failed_learners", {}).items():
        said = last_line(Path(log))  # a log line is text, not rich markup
        console.print(f"[yellow]wan-diloco: {name} did not finish (exit code {exit_code})"
                      f"{': ' + escape(said) if said else ''}; see {escape(log)}[/yellow]", highlight=False)
    if "error" in summary:
        console.print(f"[red]wan-diloco: run failed: {escape(summary['error'])}[/red]", highlight=False)
    if "stopped" in summary:
        console.print(f"[yellow]wan-diloco: {escape(summary['stopped'])}; to go on:[/yellow]", highlight=False)
        print(summary["resume"], flush=True)  # plain, on stdout: the command to copy
    resumed = summary.get("resumed")
    if resumed and resumed.get("notes"):
        for note in resumed["notes"]:
            console.print(f"wan-diloco: resumed from snapshot {resumed.get('snapshot')}: {escape(note)}", highlight=False)
    return code, summary


def _launch_plain(cfg: spec_lib.RunSpec, config_text: str, run_dir: str | None, emulate: bool, resume: bool,
                  every_s: float) -> tuple[int, dict]:
    # The launcher folds events on its own thread; each one leaves a copy of the figures for the line's thread.
    lock, latest = threading.Lock(), [progress.figures(RunState(cfg))]

    def watch(mon: RunState) -> None:
        try:
            now = progress.figures(mon)
        except (KeyError, TypeError, ValueError):
            return  # a display must not stop the run: the line keeps the figures it had
        with lock:
            latest[0] = now

    def read() -> progress.Progress:
        with lock:
            return latest[0]

    def write(line: str) -> None:
        print(line, flush=True)

    write(f"wan-diloco: {cfg.run.learners} learners, step budget {cfg.run.steps}; a progress line every "
          f"{every_s:g} s (--progress-every-s)")
    with progress.Ticker(read, write, every_s):
        return launch(cfg, config_text, run_dir, watch=watch, emulate=emulate, resume=resume)


def finish(code: int, summary: dict, args: argparse.Namespace) -> int:
    if code == 0 or "budget_steps" in summary:  # a run that ended, also short of a success: its figures
        print_summary(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return code


def planned(cfg: spec_lib.RunSpec, args: argparse.Namespace) -> spec_lib.RunSpec:
    """``cfg`` with the plan from its links (``--plan``), after printing the plan."""
    plan, facts, source, step_from, notes = plan_cli.make_plan(cfg, out, args.step_time, args.measured)
    plan_cli.print_plan(out, cfg, plan, facts, source, step_from, notes)
    if not plan.reached:
        console.print("[yellow]wan-diloco: running with the best plan found, below the CU target[/yellow]")
    return plan_cli.apply_plan(cfg, plan)


def run(args: argparse.Namespace) -> int:
    if args.resume is not None:
        return resume(args)
    if args.config is None:
        console.print("[red]wan-diloco launch: give --config TOML (or --resume RUN_DIR)[/red]")
        return 2
    cfg = spec_lib.load(args.config)
    text = Path(args.config).read_text()
    if args.plan:
        cfg = planned(cfg, args)
        text = spec_lib.dumps(cfg)  # the learners and the syncer read the planned settings
    elif args.measured or args.step_time:
        console.print("[red]wan-diloco: --measured and --step-time go with --plan[/red]")
        return 2
    code, summary = launch_and_show(cfg, text, args.run_dir, view_of(args), args.emulate,
                                    every_s=args.progress_every_s)
    return finish(code, summary, args)


def resume(args: argparse.Namespace) -> int:
    """``--resume RUN_DIR``: the same run, every process from the newest complete snapshot."""
    rdir, path = args.resume, args.resume / "config.toml"
    conflicting = [f for f, v in (("--config", args.config), ("--plan", args.plan), ("--run-dir", args.run_dir),
                                  ("--emulate", args.emulate)) if v]
    if conflicting:
        console.print(f"[red]wan-diloco launch: --resume takes the run's own config; drop {', '.join(conflicting)}[/red]")
        return 2
    if not path.is_file():
        console.print(f"[red]wan-diloco launch: {path} not found: is {rdir} a run folder of `wan-diloco launch`?[/red]")
        return 2
    cfg = spec_lib.load(path)
    code, summary = launch_and_show(cfg, path.read_text(), str(rdir), view_of(args), resume=True,
                                    every_s=args.progress_every_s)
    return finish(code, summary, args)
