"""Experiment trackers of a launched run (``run.trackers``): TensorBoard (``RUN_DIR/tensorboard``), Weights &
Biases and MLflow get the same scalars, taken from the run's events beside ``metrics.jsonl``, and W&B and MLflow
the run's config, flattened (``run.learners``; never the token).

Names follow those tools' habits: ``learner/M/loss``, ``eval/loss``, ``syncer/bytes_in`` (a syncer shard S > 0:
``syncer/S/bytes_in``); the step is the global step (what a learner's events carry, the syncer's ``global_step``).
W&B runs as its environment says (``WANDB_MODE``, ``WANDB_PROJECT``, default project ``wan-diloco``), named after
the run folder; its steps come from several processes out of order, so each row carries ``global_step`` and W&B
plots against it (``define_metric``). MLflow logs to ``MLFLOW_TRACKING_URI``, else to ``RUN_DIR/mlflow.db``
(MLflow's own default store, SQLite; its file store now refuses to start unless told to). A resumed run goes
on in the same W&B and MLflow runs (their ids are kept in ``RUN_DIR/trackers.json``).

The trackers work on a thread of their own, so a slow or unreachable tracking server never stalls the
launcher; a tracker that fails (at its start or later) is dropped with one warning event and the run goes on.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import sys
import threading
from pathlib import Path

from wan_diloco.checkpoint import write_atomic
from wan_diloco.config import ConfigError
from wan_diloco.runtime.launch_names import is_learner_name, is_syncer, learner_process, shard_of
from wan_diloco.spec import RunSpec, to_document

# tracker -> (the modules it needs, the extra that installs them); MLflow's local store is SQLAlchemy's.
PACKAGES = {"tensorboard": (("tensorboardX",), "tensorboard"), "wandb": (("wandb",), "wandb"),
            "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow")}
CLOSE_WAIT_S = 60.0  # at the end, what the trackers get to send what is left before the launcher moves on
IDS_FILE = "trackers.json"
SYNCER_FIELDS = ("mean_quorum", "bytes_in", "bytes_out", "recovery_bytes")


def check_installed(names: tuple[str, ...]) -> None:
    """ConfigError naming the extra to install for the first tracker whose package is missing (looked up,
    not imported: W&B and MLflow take seconds to import)."""
    for name in names:
        modules, extra = PACKAGES[name]
        for module in modules:
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"run.trackers: {name!r} needs the {module} package: pip install 'wan-diloco[{extra}]'")


def flat_config(cfg: RunSpec) -> dict[str, object]:
    """The run's config as ``table.key`` -> value (nested tables joined with dots), without the token."""
    out: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        elif node is not None and prefix.rpartition(".")[2] != "token":
            out[prefix] = node

    walk("", to_document(cfg))
    return out


class EventScalars:
    """Turns one event into one row, ``(wall time, global step, {name: value})``, or None when it has nothing
    to plot. Keeps what a rate or a repeat needs: each learner's last tokens, each syncer shard's last step."""

    def __init__(self) -> None:
        self.tokens: dict[int, tuple[float, int]] = {}
        self.syncer_step: dict[str, int] = {}
        self.work: dict[int, tuple[float, float]] = {}  # learner -> (compute_s, train_s) of its final

    def row(self, source: str, e: dict) -> tuple[float | None, int, dict[str, float]] | None:
        kind, t = e.get("event"), e.get("t")
        if is_syncer(source):
            step = e.get("global_step")
            # Progress comes every few hundred ms, mostly at an unchanged step: one row per step reached.
            if kind not in ("progress", "final") or not isinstance(step, int) or (
                    kind == "progress" and step <= self.syncer_step.get(source, -1)):
                return None
            self.syncer_step[source] = step
            pre = "syncer/" if source == "syncer" else f"syncer/{shard_of(source)}/"
            values = {pre + k: e.get(k) for k in SYNCER_FIELDS}
            values[pre + "versions"] = sum(e.get("versions") or ())
            return _row(t, step, values)
        if not is_learner_name(source) or learner_process(source)[1]:
            return None  # a learner's other processes: its leader speaks for it
        m = learner_process(source)[0]
        pre = f"learner/{m}/"
        if kind == "step":
            values = {pre + "loss": e.get("loss"), pre + "tokens": e.get("tokens"), pre + "bytes_sent": e.get("bytes_sent")}
            values[pre + "tokens_per_s"] = self._rate(m, t, e.get("tokens"))
            return _row(t, e.get("step"), values)
        if kind == "link":
            return _row(t, e.get("step"), {pre + "link_gbit_s": e.get("rate_gbit_s"), pre + "link_rtt_ms": e.get("rtt_ms")})
        if kind == "eval":
            return _row(t, e.get("step"), {"eval/loss": e.get("eval_loss")})
        if kind == "final":
            compute_s, train_s = e.get("compute_s"), e.get("train_s")
            values = {"eval/final_loss": e.get("final_eval_loss"), pre + "merge_lag_steps": e.get("merge_lag_steps")}
            if _number(compute_s) and _number(train_s) and train_s > 0 and (e.get("tokens") or 0) > 0:
                self.work[m] = (compute_s, train_s)
                values[pre + "goodput"] = compute_s / train_s
                # The run's so far: Σ compute / Σ train over the learners that finished (the summary's figure).
                values["run/goodput"] = sum(c for c, _ in self.work.values()) / sum(s for _, s in self.work.values())
            return _row(t, e.get("steps"), values)
        return None

    def _rate(self, m: int, t: object, tokens: object) -> float | None:
        prev = self.tokens.get(m)
        if not (_number(t) and isinstance(tokens, int)):
            return None
        self.tokens[m] = (t, tokens)
        # A restarted learner counts from zero again: no rate across that.
        if prev is None or t <= prev[0] or tokens < prev[1]:
            return None
        return (tokens - prev[1]) / (t - prev[0])


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row(t: object, step: object, values: dict[str, object]) -> tuple[float | None, int, dict[str, float]] | None:
    kept = {k: float(v) for k, v in values.items() if _number(v)}
    if not kept or not isinstance(step, int) or isinstance(step, bool):
        return None
    return (float(t) if _number(t) else None), step, kept


class TensorBoardTracker:
    def __init__(self, cfg: RunSpec, rdir: Path, run_id: str | None):
        from tensorboardX import SummaryWriter

        self.where = str(rdir / "tensorboard")
        self.id = None
        self.writer = SummaryWriter(self.where, flush_secs=10)

    def log(self, rows: list) -> None:
        for t, step, values in rows:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step, walltime=t)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: RunSpec, rdir: Path, run_id: str | None):
        import wandb

        if os.environ.get("WANDB_MODE", "online") not in ("offline", "dryrun", "disabled") and not _wandb_login(wandb):
            # Else W&B would ask on the terminal, from the trackers' thread, under the live table.
            raise RuntimeError("no W&B login: run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline")
        # console off: W&B would otherwise wrap the launcher's stdout (the live table) to copy it.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "wan-diloco", name=rdir.name,
                              dir=str(rdir), config=flat_config(cfg), id=run_id,
                              resume="allow" if run_id else None, settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")
        self.id = self.run.id
        self.where = str(Path(self.run.dir).parent) if getattr(self.run, "offline", False) else self.run.url

    def log(self, rows: list) -> None:
        for _, step, values in rows:
            self.run.log({**values, "global_step": step})

    def close(self) -> None:
        self.run.finish()


def _wandb_login(wandb) -> bool:
    try:
        return bool(wandb.login(prompt=False))  # the stored key, if any: no prompt, no network
    except TypeError:  # a W&B older than prompt=: its init says what is missing
        return True


class MlflowTracker:
    PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000  # MLflow's log_batch limits

    def __init__(self, cfg: RunSpec, rdir: Path, run_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(rdir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "wan-diloco"
            exp = self.client.get_experiment_by_name(name)
            eid = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(eid, run_name=rdir.name, tags={"wan_diloco.run_dir": str(rdir)}).info.run_id
            params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), self.PARAMS_PER_CALL):
                self.client.log_batch(run_id, params=params[i:i + self.PARAMS_PER_CALL])
        self.id = run_id
        self.where = f"{uri} (run {run_id})"

    def log(self, rows: list) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(name, value, int((t or 0) * 1000), step) for t, step, values in rows
                   for name, value in values.items()]
        for i in range(0, len(metrics), self.METRICS_PER_CALL):
            self.client.log_batch(self.id, metrics=metrics[i:i + self.METRICS_PER_CALL])

    def close(self) -> None:
        self.client.set_terminated(self.id, "FINISHED")


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The run's trackers behind one ``write(source, event)``; ``where`` says where each one logs."""

    def __init__(self, cfg: RunSpec, rdir: Path):
        self.scalars = EventScalars()
        self.rows: queue.Queue = queue.Queue()
        self.warnings: queue.Queue = queue.Queue()
        self.where: dict[str, str | None] = {}  # replaced whole by the trackers' thread: a reader never sees it change
        self.thread = threading.Thread(target=self._work, args=(cfg, Path(rdir)), name="trackers", daemon=True)
        self.thread.start()

    def write(self, source: str, event: dict) -> list[dict]:
        """Hand the event's scalars to the trackers (never waits on them); returns the warning events of
        trackers that failed since the last call, for metrics.jsonl."""
        row = self.scalars.row(source, event)
        if row is not None:
            self.rows.put(row)
        out = []
        while not self.warnings.empty():
            out.append(self.warnings.get_nowait())
        return out

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        self.rows.put(None)
        self.thread.join(wait_s)
        if self.thread.is_alive():
            print(f"wan-diloco: warning: the trackers did not finish within {wait_s:.0f} s; left behind",
                  file=sys.stderr)

    def _fail(self, name: str, e: BaseException) -> None:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"tracker {name}: {type(e).__name__}: {why}; it gets nothing more, the run goes on"
        self.warnings.put({"event": "warning", "role": "launcher", "what": what})
        print(f"wan-diloco: warning: {what}", file=sys.stderr)

    def _work(self, cfg: RunSpec, rdir: Path) -> None:
        ids_path = rdir / IDS_FILE
        try:
            ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        except (OSError, ValueError):
            ids = {}
        live = {}
        for name in cfg.run.trackers:
            try:
                live[name] = TRACKERS[name](cfg, rdir, ids.get(name))
                self.where = {**self.where, name: live[name].where}
            except Exception as e:  # noqa: BLE001 - whatever a tracker raises, the run goes on without it
                self._fail(name, e)
        try:
            write_atomic(ids_path, json.dumps({**ids, **{n: t.id for n, t in live.items() if t.id}}).encode())
        except OSError as e:  # a resume starts new tracker runs; this one logs all the same
            print(f"wan-diloco: warning: {ids_path}: {e.strerror or e}", file=sys.stderr)
        done = False
        while not done:
            rows = [self.rows.get()]
            while not self.rows.empty():  # whatever queued meanwhile goes in one call
                rows.append(self.rows.get_nowait())
            done = rows[-1] is None
            rows = [r for r in rows if r is not None]
            for name, tracker in list(live.items()):
                try:
                    if rows:
                        tracker.log(rows)
                except Exception as e:  # noqa: BLE001
                    self._fail(name, e)
                    del live[name]
        for name, tracker in live.items():
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                self._fail(name, e)
