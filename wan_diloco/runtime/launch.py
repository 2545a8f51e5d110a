"""A whole local run: ``launch`` starts a ``Cluster`` (a syncer and M learners, each in its own process
group), sends every event to ``RUN_DIR/metrics.jsonl``, folded into a ``RunState``; Ctrl-C or SIGTERM
stops every child after a last snapshot and prints how to resume; a run that cannot continue (the syncer
died, or every learner did) ends with the reason. The pieces live in modules of their own, and their
public names are re-exported here for the callers that import them from this module:

- ``launch_cluster``: process supervision (``Cluster``, ``Child``, the children's environment, logs)
- ``launch_names``: the children's names (``syncer-S``, ``learner-N.pI``)
- ``launch_prep``: what the processes read (``run_spec``, ``write_config``, ``emulated_spec``)
- ``launch_stop``: a stop or a failure (``RunStopped``, ``RunFailed``, the last snapshot, exit 130)
- ``launch_summary``: the run's state and figures (``RunState``, ``summarize``, ``verdict``)
"""
from __future__ import annotations

import contextlib
import json
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from wan_diloco.checkpoint import CheckpointError, describe_os_error
from wan_diloco.regions import Emulator, EmulatorError
from wan_diloco.runtime.launch_cluster import (PARENT_ENV, THREAD_ENV, Child, Cluster, child_env, die_with_parent,
                                               died, free_port, last_line, last_lines)
from wan_diloco.runtime.launch_names import (is_learner_name, is_syncer, learner_of, learner_process, process_name,
                                             shard_name, shard_of)
from wan_diloco.runtime.launch_prep import emulated_spec, region_of, run_spec, write_config
from wan_diloco.runtime.launch_stop import (STOP_SNAPSHOT_S, STOPPED_EXIT, RunFailed, RunStopped, stop_signals,
                                            stop_snapshot)
from wan_diloco.runtime.launch_summary import (RunState, first_starts, joined_final, summarize, trained_finals,
                                               verdict)
from wan_diloco.spec import RunSpec

__all__ = [  # the names other modules, tests and benchmarks import from here
    "PARENT_ENV", "STOPPED_EXIT", "STOP_SNAPSHOT_S", "THREAD_ENV", "Child", "Cluster", "RunFailed", "RunState",
    "RunStopped", "child_env", "die_with_parent", "died", "emulated_spec", "first_starts", "free_port",
    "is_learner_name", "is_syncer", "join_shard_params", "joined_final", "last_line", "last_lines", "launch",
    "learner_of", "learner_process", "process_name", "region_of", "run_spec", "shard_name", "shard_of",
    "stop_signals", "stop_snapshot", "summarize", "trained_finals", "verdict", "write_config",
]


def join_shard_params(cfg: RunSpec, shards: int) -> Path | None:
    """The shards' final parameters as one file (``checkpoint.dir/params.safetensors``); CheckpointError
    naming a shard's file that is missing, OSError if the joined file cannot be written."""
    from wan_diloco.checkpoint.params import join_params

    root = Path(cfg.checkpoint.dir)
    parts = [root / f"params.shard-{s}.safetensors" for s in range(shards)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]} is missing")
    return join_params(parts, root / "params.safetensors")


def launch(cfg: RunSpec, config_text: str, run_dir: str | None = None,
           watch: Callable[[RunState], None] | None = None, emulate: bool | Emulator = False,
           emulator_prefix: str = "wdl", resume: bool = False) -> tuple[int, dict]:
    """Run everything to the end; returns (exit code, summary). ``watch(state)`` sees every update.

    With ``emulate`` the syncer and every learner run in their region's network
    namespace of an emulated WAN built from ``[regions]`` (``regions.Emulator``,
    needs root), over TLS with a throwaway CA made for the run (cleartext is
    refused off loopback); the resolved config is ``RUN_DIR/config.toml``. An
    ``Emulator`` already entered (a benchmark that changes links during the
    run) is used as it is and left up.

    The summary of a failed run has ``error`` (why); ``failed_learners`` names learners
    that did not finish a run that otherwise did.

    With ``resume`` (``run_dir`` required, ``cfg`` read from its config.toml) every process starts
    from the newest complete snapshot under the run's checkpoint.dir."""
    from wan_diloco.assemble import preflight  # JAX and the model: not for `wan-diloco --help`

    preflight(cfg)  # a missing corpus or too many fragments: one ConfigError, before any process starts
    cfg.given_token()  # a short run.token or $WAN_DILOCO_TOKEN: ConfigError before the run folder is made
    if cfg.run.trackers:
        from wan_diloco.runtime.trackers import check_installed

        check_installed(cfg.run.trackers)  # ConfigError now, not after the processes started
    rdir = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        cfg = cfg if resume else run_spec(cfg, rdir)
        if not emulate and not resume:
            write_config(rdir / "config.toml", cfg)
    except OSError as e:  # a full or read-only disk: the launcher's own files, one line and no traceback
        return 1, {"error": f"cannot write the run folder {rdir}: {describe_os_error(e)}", "run_dir": str(rdir)}
    if not emulate:
        return _run(cfg, rdir, watch, resume=resume)
    try:
        with contextlib.ExitStack() as stack:
            emu = emulate if isinstance(emulate, Emulator) else stack.enter_context(
                Emulator(cfg.regions, prefix=emulator_prefix))
            ecfg = emulated_spec(cfg, emu, rdir / "tls")
            write_config(rdir / "config.toml", ecfg)
            info = {"backend": emu.backend, "namespaces": emu.describe()}
            code, summary = _run(ecfg, rdir, watch, wrap=lambda name: emu.netns_argv(region_of(ecfg, name)),
                                 resume=resume)
            return code, {**summary, "emulator": info}
    except EmulatorError as e:
        return 1, {"error": f"emulated WAN: {e}", "run_dir": str(rdir)}


def _run(cfg: RunSpec, rdir: Path, watch: Callable[[RunState], None] | None,
         wrap: Callable[[str], list[str]] | None = None, resume: bool = False) -> tuple[int, dict]:
    with stop_signals() as stop:
        return _supervise(cfg, rdir, watch, wrap, resume, stop)


def _supervise(cfg: RunSpec, rdir: Path, watch: Callable[[RunState], None] | None,
               wrap: Callable[[str], list[str]] | None, resume: bool, stop: dict) -> tuple[int, dict]:
    mon, t0 = RunState(cfg), time.monotonic()
    tb = None
    if cfg.run.trackers:
        from wan_diloco.runtime.trackers import Trackers

        tb = Trackers(cfg, rdir)
    try:
        with Cluster(cfg, rdir / "config.toml", rdir, wrap=wrap) as cluster, \
                open(rdir / "metrics.jsonl", "a" if resume else "w") as mf:
            try:
                cluster.start_syncers(resume=resume)
            except RuntimeError as e:
                raise RunFailed(str(e)) from None
            read_out: set[str] = set()  # children whose every event has been taken (their "exit" came)

            def take(name: str, e: dict) -> None:
                if e.get("event") == "exit":
                    read_out.add(name)
                mf.write(json.dumps({"source": name, **e}) + "\n")
                mon.fold(name, e)
                if tb is not None:
                    for w in tb.write(name, e):  # a tracker that failed: its one warning, beside the events
                        mf.write(json.dumps({"source": "launcher", **w}) + "\n")
                if watch is not None:
                    watch(mon)

            def ended(c: Child) -> int | None:
                # Exited only once its last event is taken: an exit code alone can come before the final
                # report is read, and the verdict would then miss a lost result.
                return c.code_after_output() if c.name in read_out else None

            for m in range(cfg.run.learners):
                if stop["sig"]:
                    break
                cluster.start_learner(m, resume=resume)
            while True:
                if stop["sig"]:
                    # A stop, not a failure: a last snapshot when the syncer can cut one, then every child stops.
                    snap = stop_snapshot(cluster, take, stop)
                    raise RunStopped(f"stopped by {signal.Signals(stop['sig']).name}" +
                                     (f"; snapshot {snap} taken" if snap is not None else
                                      "; no final snapshot (the newest earlier one is resumed)"))
                try:
                    take(*cluster.events.get(timeout=0.25))
                except queue.Empty:
                    pass
                syncers = [c for n, c in cluster.children.items() if is_syncer(n)]
                learners = [c for n, c in cluster.children.items() if not is_syncer(n) and not learner_process(n)[1]]
                finished = {0: mon.syncer_final, **mon.shard_finals}
                for c in syncers:
                    lost = (finished.get(shard_of(c.name)) or {}).get("params_error")
                    if ended(c) is not None and lost:  # the run's result: not a success, and not a crash
                        raise RunFailed(f"final parameters not written: {lost}")
                    if ended(c) is not None and (ended(c) != 0 or finished.get(shard_of(c.name)) is None):
                        raise RunFailed(f"the syncer died: {died(c)}" if c.name == "syncer" else
                                        f"syncer shard {shard_of(c.name)} died: {died(c)}")
                if all(ended(c) is not None for c in syncers):
                    # Followers too: they exit once their leader told them (their logs end complete).
                    if all(ended(c) is not None for n, c in cluster.children.items() if not is_syncer(n)):
                        break
                elif all(ended(c) is not None and ended(c) != 0 for c in learners):
                    raise RunFailed("every learner died:\n" + "\n".join(died(c, lines=3) for c in learners))
        failed = {c.name: (c.exit_code, str(c.log_path)) for n, c in cluster.children.items()
                  if not is_syncer(n) and not learner_process(n)[1] and c.exit_code != 0}
        summary = {**summarize(mon, time.monotonic() - t0), "run_dir": str(rdir), "failed_learners": failed,
                   "trackers": tb.where if tb is not None else None}
        if cfg.syncer.shards > 1 and cfg.checkpoint.dir:
            try:
                summary["params_path"] = str(join_shard_params(cfg, cfg.syncer.shards))
            except (OSError, CheckpointError) as e:  # the run's result is not there: not a success
                why = describe_os_error(e) if isinstance(e, OSError) else str(e)
                where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
                return 1, {**summary, "params_path": None,
                           "error": f"final parameters not written: joining the shards' files: {where}{why}"}
        try:
            from wan_diloco.runtime.run_plot import plot_labels, plot_run

            # Never an untrained copy's eval: a late joiner's start, a learner that finished with nothing trained.
            plot_run(mon.losses, mon.evals, [s["eval_loss"] for s in first_starts(mon).values()],
                     [(f["steps"], f["final_eval_loss"]) for f in trained_finals(mon).values()], rdir / "loss.png",
                     tokens=mon.tokens, **plot_labels(cfg))
            summary["loss_png"] = str((rdir / "loss.png").absolute())  # whole in a log, wherever it is read
        except (OSError, ValueError) as e:  # a picture is not worth failing a finished run for
            summary["loss_png"] = None
            print(f"wan-diloco: could not draw the loss curve: {e}", file=sys.stderr)
        problems = verdict(summary)
        if problems:  # it ended, but not as a success: exit status and summary say so
            return 1, {**summary, "error": "; ".join(problems)}
        return 0, summary
    except RunStopped as e:
        return STOPPED_EXIT, {"stopped": str(e), "run_dir": str(rdir), "resume": f"wan-diloco launch --resume {rdir}"}
    except RunFailed as e:
        return (STOPPED_EXIT if stop["sig"] else 1), {"error": str(e), "run_dir": str(rdir)}
    except OSError as e:  # the launcher's own files (logs, metrics.jsonl) on a full or read-only disk
        where = e.filename or rdir
        return 1, {"error": f"the launcher failed on {where}: {describe_os_error(e)}; every process was stopped",
                   "run_dir": str(rdir)}
    finally:
        if tb is not None:
            tb.close()
