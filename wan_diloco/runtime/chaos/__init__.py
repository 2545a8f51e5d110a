"""Chaos harness (#13): a real multi-process run under a schedule of faults, and what it cost.

A run is a ``Cluster`` (syncer + M learners as local processes, on loopback, or
in an emulated WAN's namespaces) with its folder, config and snapshots laid out
as ``launch`` does (``RUN_DIR/config.toml``, ``RUN_DIR/checkpoints``,
``RUN_DIR/metrics.jsonl``, a log per process). While it trains, faults fire at
their time (seconds after every learner logged ``start``, i.e. began training: start-up takes
seconds to minutes on a loaded machine, and a schedule should mean the same everywhere):

- ``kill_learner``: SIGKILL; restarted with ``--resume`` after ``down_s`` (default 5 s). It
  takes up its part of the snapshot the syncer resumed from when there is one, else it joins
  like a new learner.
- ``stop_learner``: SIGSTOP for ``duration_s`` (default 5 s), then SIGCONT (a hung host).
- ``kill_syncer``: SIGKILL; restarted with ``--resume`` after ``down_s``: it takes up the newest
  complete snapshot and the running learners rejoin it.
- ``cut_link``: drop every packet of a region's link for ``duration_s`` (``Emulator.cut``); only
  in an emulated run, skipped with a note otherwise.
- ``disk_full``: the syncer's checkpoint disk is full for ``duration_s`` (default 5 s): every
  snapshot part, manifest and final-parameter write of the syncer fails with ENOSPC meanwhile
  (the test hook ``checkpoint.format.FAULT_ENV``, set only for the syncers of a schedule that has
  this fault). The run must go on, loudly, and write its snapshots and weights once space returns.
- ``restart_syncer_fresh``: SIGKILL; after ``down_s`` the supervisor restarts it *without*
  ``--resume``, which must be refused (exit 2, one line: the folder holds snapshots), then runs the
  operator's second command, the restart with ``--resume``. Skipped while ``checkpoint.dir`` holds
  no complete snapshot (nothing to refuse over, nothing to resume).

A schedule is a JSON list of faults, or TOML ``[[fault]]`` entries, each
``{t_s, kind, target, down_s | duration_s}`` (``load_schedule``); or it is made
by ``round_robin`` (a learner killed every N seconds plus one syncer kill) or
from a failure tape of ``wan-diloco goodput --tape`` (``from_tape``).

Everything the run did is kept in a ``RunRecord`` (every process's events,
when each process lived, when each fault fired) which ``analyze`` turns into
the report; see its docstring for how each figure is defined.
"""
from wan_diloco.runtime.chaos.baseline import config_summary, run_with_baseline, write_report
from wan_diloco.runtime.chaos.driver import ChaosOptions, run_chaos
from wan_diloco.runtime.chaos.plot import plot_timeline
from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.report import analyze, rolled_back_steps, targets, tokens_trained
from wan_diloco.runtime.chaos.schedule import (
    DEFAULT_HOLD_S, KINDS, SYNCER_KINDS, Fault, check_schedule, from_tape, learner_index, learner_name, load_schedule,
    parse_fault, parse_schedule, round_robin,
)

__all__ = [
    "DEFAULT_HOLD_S", "KINDS", "SYNCER_KINDS", "ChaosOptions", "Fault", "RunRecord", "analyze", "check_schedule", "config_summary",
    "from_tape", "learner_index", "learner_name", "load_schedule", "parse_fault", "parse_schedule",
    "plot_timeline", "rolled_back_steps", "round_robin", "run_chaos", "run_with_baseline", "targets",
    "tokens_trained", "write_report",
]
