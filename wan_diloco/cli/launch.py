"""`wan-diloco launch --config F`: a syncer and M learners as local processes, a live table, a summary.

Every JSON event of every process goes to ``RUN_DIR/metrics.jsonl`` (with its
source); each process's stderr to ``RUN_DIR/<name>.log``. Ctrl-C or SIGTERM
stops every child. The exit code is non-zero, with the reason, when the run
cannot continue (the syncer died, or every learner did).
"""
from __future__ import annotations

import argparse
import json
import queue
import signal
import time
from pathlib import Path

from rich.live import Live
from rich.table import Table

from wan_diloco.cli.report import human_bytes, console, out
from wan_diloco import spec as spec_lib
from wan_diloco.runtime.launch import Cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", required=True, help="run config (see examples/local.toml)")
    add_common(p)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", metavar="DIR", help="where metrics.jsonl and logs go (default: run.run_dir/<time>)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no live table")


class RunFailed(Exception):
    """The run cannot continue; the text says why."""


class Monitor:
    """Latest state of every process, folded from their events."""

    def __init__(self, cfg: spec_lib.RunSpec):
        self.cfg = cfg
        self.learners: dict[int, dict] = {m: {"region": cfg.run.region(m), "status": "starting"}
                                          for m in range(cfg.run.learners)}
        self.syncer: dict = {}
        self.syncer_final: dict | None = None
        self.finals: dict[int, dict] = {}
        self.starts: dict[int, dict] = {}

    def fold(self, name: str, e: dict) -> None:
        kind = e.get("event")
        if name == "syncer":
            if kind == "final":
                self.syncer_final = e
            if kind in ("progress", "final", "listening"):
                self.syncer.update(e)
            return
        m = int(name.rpartition("-")[2])
        row = self.learners[m]
        if kind == "start":
            self.starts.setdefault(m, e)
            row["status"] = "training"
        elif kind == "step":
            row.update(e)
        elif kind == "final":
            self.finals[m] = e
            row.update(status="done", step=e["steps"], loss=e["last_loss"], tokens=e["tokens"],
                       bytes_sent=e["bytes_sent"])
        elif kind == "exit" and row.get("status") != "done":
            row["status"] = "exited"

    def table(self) -> Table:
        t = Table(title=f"wan-diloco: {self.cfg.run.learners} learners, step budget {self.cfg.run.steps}")
        for col in ("process", "region", "step", "loss", "tokens", "sent", "status"):
            t.add_column(col, justify="left" if col in ("process", "region", "status") else "right")
        for m, r in self.learners.items():
            loss = r.get("loss")
            t.add_row(f"learner-{m}", r["region"], str(r.get("step", "")), f"{loss:.3f}" if loss is not None else "",
                      f"{r.get('tokens', 0):,}", human_bytes(r.get("bytes_sent", 0)), r["status"])
        s = self.syncer
        t.add_row("syncer", "", str(s.get("global_step", "")), "", "", human_bytes(s.get("bytes_out", 0)),
                  f"versions {s.get('versions', '')}")
        return t


def summarize(mon: Monitor, wall_s: float) -> dict:
    cfg, finals = mon.cfg, list(mon.finals.values())
    sf = mon.syncer_final or {}
    params = int(mon.syncer.get("params", 0))
    M = cfg.run.learners
    dp_bytes = cfg.run.steps * 2 * (M - 1) / M * params * 4 * M
    sent = int(sf.get("bytes_in", 0)) + int(sf.get("bytes_out", 0))
    raw = sum(f["raw_bytes"] for f in finals)
    payload = sum(f["payload_bytes"] for f in finals)
    digests = sf.get("digests")
    return {
        "learners_finished": len(finals), "learners": M,
        "initial_eval_loss": sum(s["eval_loss"] for s in mon.starts.values()) / max(1, len(mon.starts)),
        "final_eval_loss": sum(f["final_eval_loss"] for f in finals) / max(1, len(finals)),
        "tokens": sum(f["tokens"] for f in finals), "global_steps": sf.get("global_step", 0),
        "goodput": sum(f["compute_s"] for f in finals) / max(1e-9, sum(f["train_s"] for f in finals)),
        "fragment_syncs": sf.get("fragment_syncs", []), "mean_quorum": sf.get("mean_quorum", 0.0),
        "late_carried": sf.get("late_carried", 0),
        "bytes_sent": sent, "dp_bytes": dp_bytes, "compression_ratio": raw / payload if payload else 1.0,
        "bit_identical": bool(digests) and all(f["digests"] == digests for f in finals),
        "params": params, "wall_s": wall_s,
    }


def print_summary(s: dict) -> None:
    t = Table(title="networked run", show_header=False)
    rows = [
        ("eval loss", f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}"),
        ("learners finished", f"{s['learners_finished']} / {s['learners']}"),
        ("tokens", f"{s['tokens']:,}"),
        ("global steps", str(s["global_steps"])),
        ("goodput", f"{s['goodput']:.1%}"),
        ("fragment syncs", " ".join(map(str, s["fragment_syncs"]))),
        ("mean quorum (late Δs carried)", f"{s['mean_quorum']:.2f} ({s['late_carried']})"),
        ("bytes sent (learners <-> syncer)", human_bytes(s["bytes_sent"])),
        ("data parallel, same steps", f"{human_bytes(s['dp_bytes'])} ({s['dp_bytes'] / max(1, s['bytes_sent']):.0f}x more)"),
        ("compression ratio", f"{s['compression_ratio']:.2f}x"),
        ("final fragments bit-identical", "yes" if s["bit_identical"] else "NO"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    out.print()
    out.print(t)


def launch(cfg: spec_lib.RunSpec, config_text: str, run_dir: str | None = None,
           quiet: bool = False) -> tuple[int, dict]:
    """Run everything to the end; returns (exit code, summary)."""
    rdir = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "config.toml").write_text(config_text)
    mon, t0 = Monitor(cfg), time.monotonic()
    stop = {"sig": 0}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Cluster(cfg, rdir / "config.toml", rdir) as cluster, open(rdir / "metrics.jsonl", "w") as mf, \
                Live(mon.table(), console=console, refresh_per_second=4, transient=False) if not quiet \
                else _Null() as live:
            try:
                cluster.start_syncer()
            except RuntimeError as e:
                raise RunFailed(str(e)) from None
            for m in range(cfg.run.learners):
                cluster.start_learner(m)
            while True:
                if stop["sig"]:
                    raise RunFailed(f"stopped by {signal.Signals(stop['sig']).name}; all processes terminated")
                try:
                    name, e = cluster.events.get(timeout=0.25)
                    mf.write(json.dumps({"source": name, **e}) + "\n")
                    mon.fold(name, e)
                    live.update(mon.table())
                except queue.Empty:
                    pass
                sync = cluster.children["syncer"]
                learners = [c for n, c in cluster.children.items() if n != "syncer"]
                if sync.exit_code is not None:
                    if sync.exit_code != 0 or mon.syncer_final is None:
                        raise RunFailed(f"the syncer died (exit code {sync.exit_code}); see {sync.log_path}")
                    if all(c.exit_code is not None for c in learners) and cluster.events.empty():
                        break
                elif all(c.exit_code is not None and c.exit_code != 0 for c in learners):
                    codes = ", ".join(f"{c.name}: {c.exit_code}" for c in learners)
                    raise RunFailed(f"every learner died ({codes}); see the logs in {rdir}")
        failed = [c.name for n, c in cluster.children.items() if n != "syncer" and c.exit_code != 0]
        for name in failed:
            console.print(f"[yellow]wan-diloco: {name} did not finish (exit code "
                          f"{cluster.children[name].exit_code}); see {cluster.children[name].log_path}[/yellow]")
        summary = {**summarize(mon, time.monotonic() - t0), "run_dir": str(rdir), "failed_learners": failed}
        return 0, summary
    except RunFailed as e:
        console.print(f"[red]wan-diloco: run failed: {e}[/red]")
        return (128 + stop["sig"] if stop["sig"] else 1), {"error": str(e), "run_dir": str(rdir)}
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *_):
        pass


def finish(code: int, summary: dict, args: argparse.Namespace) -> int:
    if code == 0:
        print_summary(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return code


def run(args: argparse.Namespace) -> int:
    cfg = spec_lib.load(args.config)
    code, summary = launch(cfg, Path(args.config).read_text(), args.run_dir, args.quiet)
    return finish(code, summary, args)
