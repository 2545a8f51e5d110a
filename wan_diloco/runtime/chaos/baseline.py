"""A chaos run beside its fault-free twin (same config, same step budget), and the report of both."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from wan_diloco.runtime.chaos.driver import ChaosOptions, run_chaos
from wan_diloco.runtime.chaos.plot import plot_timeline
from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.report import analyze
from wan_diloco.runtime.chaos.schedule import Fault, Note
from wan_diloco.spec import RunSpec


def write_report(report: dict, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=1) + "\n")


def config_summary(cfg: RunSpec) -> dict:
    """The settings a chaos report is read against."""
    return {"learners": cfg.run.learners, "steps": cfg.run.steps, "min_step_s": cfg.run.min_step_s,
            "preset": cfg.preset, "model": dataclasses.asdict(cfg.model),
            "sync_every": cfg.learner.sync_every, "num_fragments": cfg.learner.num_fragments, "tau": cfg.learner.tau,
            "quorum": cfg.syncer.quorum, "every_merges": cfg.checkpoint.every_merges,
            "liveness_timeout_s": cfg.syncer.liveness_timeout_s, "retry_budget_s": cfg.transport.retry_budget_s}


def run_with_baseline(cfg: RunSpec, faults: list[Fault], run_dir: str | Path, options: ChaosOptions = ChaosOptions(),
                      baseline: bool = True, note: Note = lambda s: None,
                      png: str | Path | None = None) -> tuple[dict, RunRecord, RunRecord | None]:
    """The chaos run in ``RUN_DIR/chaos`` and (``baseline``) the same config without faults in
    ``RUN_DIR/baseline``; returns (report, chaos record, baseline record), and draws ``png``."""
    rdir = Path(run_dir)
    note(f"chaos run: {len(faults)} faults, {cfg.run.learners} learners, {cfg.run.steps} steps -> {rdir / 'chaos'}")
    record = run_chaos(cfg, faults, rdir / "chaos", options, note)
    base = None
    if baseline:
        note(f"fault-free run of the same config -> {rdir / 'baseline'}")
        base = run_chaos(cfg, [], rdir / "baseline", options, note)
    report = {**analyze(record, base), "config": config_summary(cfg)}
    if png is not None:
        plot_timeline(record, png, base)
    return report, record, base
