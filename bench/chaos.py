#!/usr/bin/env python
"""Chaos benchmark (#13, #23): a real run with learners killed round-robin, syncer kills + resumes and a
full checkpoint disk, against the same config without faults.

Real processes on loopback (``runtime.chaos``): a syncer and M learners of the
micro model (d_model 32, 2 layers), steps paced to ``STEP_S`` (``run.min_step_s``)
so the run lasts long enough to contain the faults. A learner is killed every
``every_s`` seconds (learner-0, learner-1, ... in turn) and restarted with
``--resume`` 5 s later; the syncer is killed once, mid-run, and restarted with
``--resume`` ``SYNCER_DOWN_S`` later (a supervisor restarting it); the running
learners rejoin the snapshot it resumed. Two faults of #23: the syncer's
checkpoint disk is full for ``DISK_FULL_S`` (a minute; every snapshot write
fails with ENOSPC meanwhile: the run goes on, loudly, and writes snapshots and
its final weights once space returns), and a syncer kill whose supervisor
first restarts it *without* ``--resume`` (refused: exit 2, one line), then
runs the operator's second command with ``--resume`` (``restart_syncer_fresh``;
in ``--quick`` it is the run's one syncer kill, so that a single outage stays
in its 3.5 minutes). Fault times count from when every learner started
training. Then the fault-free run of the same config and step budget. Figures
and their definitions: ``runtime.chaos.analyze``; each of the two #23 faults
has a ``check`` in its ``faults`` entry.

Targets from the issue, reported as measured (``notes.targets``): the run
finishes, uptime >= 0.9, final eval loss within 2 % of the fault-free run.

    python -m bench.chaos --quick   # M = 2, a kill every 30 s, ~3.5 min of training per run: < 10 min in all
    python -m bench.chaos           # M = 3, a kill every minute, ~9 min of training per run
    python -m bench.chaos --quick --reanalyze DIR   # the report again from the runs recorded in DIR (--work)
    python -m bench.chaos --hostile [--messages N]  # the hostile-peer benchmark instead (bench/hostile.py)
Writes bench/results/chaos.json (after each run) and chaos.png; with --quick chaos_quick.json and .png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wan_diloco import spec as spec_lib  # noqa: E402
from wan_diloco.runtime import chaos  # noqa: E402

STEP_S = 0.2  # every step padded to this: 1 + M processes share 2 cores, and compute is not what is measured
LEARNER_DOWN_S = 5.0
SYNCER_DOWN_S = 1.0
DISK_FULL_S = 60.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    learners: int
    train_s: float  # paced training time: steps = train_s / STEP_S
    every_s: float  # a learner killed this often
    syncer_at_s: float | None  # kill_syncer (restarted with --resume)
    margin_s: float  # no learner kill in the last margin_s: a restart has time to come back
    fresh_at_s: float  # restart_syncer_fresh: killed, a start without --resume refused, then --resume
    disk_full_at_s: float  # disk_full for DISK_FULL_S

    @property
    def steps(self) -> int:
        return int(round(self.train_s / STEP_S))


# The disk-full minute lies clear of the syncer outages: a resume from a snapshot older than the window
# would roll back the whole minute.
QUICK = Scenario(learners=2, train_s=210.0, every_s=30.0, syncer_at_s=None, margin_s=60.0, fresh_at_s=75.0,
                 disk_full_at_s=100.0)
FULL = Scenario(learners=3, train_s=540.0, every_s=60.0, syncer_at_s=270.0, margin_s=60.0, fresh_at_s=400.0,
                disk_full_at_s=100.0)

CONFIG = """\
[run]
learners = {learners}
steps = {steps}
batch_size = 8
seed = 0
eval_batches = 4
eval_batch_size = 16
eval_every_steps = 100
tick_s = 0.2
report_every_s = 0.5
min_step_s = {step_s}

[data]
max_bytes = 1048576

[model]
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 64
seq_len = 32

[learner]
sync_every = 8
num_fragments = 2
tau = 2

[syncer]
quorum = 1
liveness_timeout_s = 20.0
final_timeout_s = 30

[train]
warmup_steps = 10

[transport]
channels = 1
call_timeout_s = 10.0
# Running learners retry an absent syncer this long: more than a resume takes on a loaded machine.
retry_budget_s = 90.0

[checkpoint]
every_merges = 8
keep = 3
"""

DEFINITIONS = {
    "recovered_s": "fault -> a restarted learner logs a step / the resumed syncer merges again",
    "uptime": "share of the training span (first merge to the first learner's finishing) not inside a gap "
              "between merges longer than max(3 s, 3 x median gap)",
    "goodput": "sum of learner compute seconds / sum of wall seconds the learner slots were supposed to train",
    "recovery_bytes": "bytes_received of restarted learners at their start (join + peer state) + bytes_received "
                      "growth across rejoins of the resumed syncer",
    "loss_ratio": "final eval loss / the fault-free run's eval loss at the tokens the faulty run trained (read off "
                  "its eval curve, run.eval_every_steps; notes.loss_ratio_equal_steps compares final losses at equal steps)",
    "lost_s": "learner-seconds: kill -> stepping again, plus steps rolled back by the resume x step time",
    "check (disk_full)": "the syncer's failed writes in the window, /status storage not ok in it and ok again after "
                         "(s after space returned), a complete snapshot after it, the final parameters written",
    "check (restart_syncer_fresh)": "the start without --resume exited 2 with 'refusing to start', and the --resume "
                                    "start came up at the killed syncer's epoch + 1",
}


def scenario_faults(s: Scenario) -> list[chaos.Fault]:
    faults = chaos.round_robin(s.learners, s.every_s, s.train_s - s.margin_s, s.syncer_at_s,
                               down_s=LEARNER_DOWN_S, syncer_down_s=SYNCER_DOWN_S)
    faults += [chaos.Fault(s.fresh_at_s, "restart_syncer_fresh", "syncer", SYNCER_DOWN_S),
               chaos.Fault(s.disk_full_at_s, "disk_full", "syncer", DISK_FULL_S)]
    return sorted(faults, key=lambda f: f.t_s)


def save(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def report(record: chaos.RunRecord, base: chaos.RunRecord | None, cfg, s: Scenario, t_bench: float) -> dict:
    rep = {**chaos.analyze(record, base), "config": {**chaos.config_summary(cfg), **dataclasses.asdict(s),
                                                      "learner_down_s": LEARNER_DOWN_S, "syncer_down_s": SYNCER_DOWN_S,
                                                      "disk_full_s": DISK_FULL_S,
                                                      "transport": "loopback"}}
    rep["notes"].update(definitions=DEFINITIONS, bench_wall_s=round(time.monotonic() - t_bench, 1),
                        host=f"{platform.machine()}, {platform.python_version()}",
                        partial=None if base is not None else "the fault-free run has not run yet")
    return rep


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--hostile" in argv:  # a fault of another kind: a compromised peer, not dead processes
        from bench import hostile

        return hostile.main([a for a in argv if a != "--hostile"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hostile", action="store_true",
                    help="run the hostile-peer benchmark instead (bench/hostile.py; its flags follow, see --hostile --help)")
    ap.add_argument("--quick", action="store_true", help="M = 2, a kill every 30 s, ~3 min of training per run")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: bench/results/chaos.json, chaos_quick.json with --quick)")
    ap.add_argument("--work", type=Path, help="run folders (default: a new temporary folder, kept)")
    ap.add_argument("--reanalyze", type=Path, metavar="WORK",
                    help="no runs: the report and plot again from WORK/{chaos,baseline}/chaos_record.json")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.out is None:  # a quick check never overwrites the full run's figures
        args.out = ROOT / "bench" / "results" / ("chaos_quick.json" if args.quick else "chaos.json")
    t_bench = time.monotonic()
    cfg = spec_lib.from_document(tomllib.loads(CONFIG.format(learners=s.learners, steps=s.steps, step_s=STEP_S)))
    if args.reanalyze:
        record, base = (recorded(args.reanalyze / name, cfg) for name in ("chaos", "baseline"))
        out = report(record, base, cfg, s, t_bench)
        previous = json.loads(args.out.read_text()).get("notes", {}) if args.out.exists() else {}
        out["notes"].update(bench_wall_s=previous.get("bench_wall_s"),
                            reanalyzed=f"report rebuilt from the runs recorded in {args.reanalyze}")
    else:
        record, base = measure(cfg, s, args.work or Path(tempfile.mkdtemp(prefix="wdl-chaos-bench-")), args.out, t_bench)
        out = report(record, base, cfg, s, t_bench)
    save(out, args.out)
    png = args.out.with_suffix(".png")
    kills = [f"{s.syncer_at_s:g} s"] if s.syncer_at_s is not None else []
    chaos.plot_timeline(record, png, base, title=f"chaos: M = {s.learners}, a learner killed every {s.every_s:g} s, "
                                                 f"syncer killed at {', '.join(kills + [f'{s.fresh_at_s:g} s (fresh)'])}, "
                                                 f"disk full {s.disk_full_at_s:g}-{s.disk_full_at_s + DISK_FULL_S:g} s")
    from wan_diloco.cli.chaos import print_report

    print_report(out)
    print(f"targets: {out['notes']['targets']}")
    print(f"wrote {args.out} and {png}")
    return 0 if out["notes"]["finished"] else 1


def measure(cfg, s: Scenario, work: Path, out: Path, t_bench: float) -> tuple[chaos.RunRecord, chaos.RunRecord]:
    """The chaos run, then the fault-free one; the report is saved after each."""
    faults = scenario_faults(s)
    note = lambda line: print(line, flush=True)  # noqa: E731
    options = chaos.ChaosOptions(timeout_s=s.train_s * 2 + 180)
    note(f"chaos: {len(faults)} faults, M = {s.learners}, {s.steps} steps at {STEP_S} s -> {work / 'chaos'}")
    record = chaos.run_chaos(cfg, faults, work / "chaos", options, note)
    save(report(record, None, cfg, s, t_bench), out)  # a failure later keeps what was measured
    note(f"fault-free run of the same config -> {work / 'baseline'}")
    return record, chaos.run_chaos(cfg, [], work / "baseline", options, note)


def recorded(run_dir: Path, cfg) -> chaos.RunRecord:
    record = chaos.RunRecord.from_json((run_dir / "chaos_record.json").read_text())
    if not record.tokens_per_step:  # recorded before the field existed
        record = dataclasses.replace(record, tokens_per_step=cfg.run.batch_size * cfg.model.seq_len)
    return record


if __name__ == "__main__":
    sys.exit(main())
