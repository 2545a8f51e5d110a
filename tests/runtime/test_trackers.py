"""run.trackers: a recorded event sequence fed to TensorBoard, W&B (offline) and MLflow (a local store), each
read back from what it wrote; a tracker that fails is one warning and the others go on."""
import json
import struct

import pytest

from wan_diloco import spec as spec_lib
from wan_diloco.config import ConfigError
from wan_diloco.runtime import trackers
from wan_diloco.runtime.trackers import EventScalars, Trackers

TOKEN = "a-secret-token-that-no-tracker-may-see-0123"

# What a run's processes said, in the order the launcher got it (fields as the real events carry them).
EVENTS = [
    ("syncer", {"event": "progress", "t": 100.0, "global_step": 0, "versions": [0, 0], "mean_quorum": 0.0,
                "bytes_in": 0, "bytes_out": 0, "recovery_bytes": 0}),
    ("learner-0", {"event": "start", "t": 100.5, "step": 0, "eval_loss": 5.5}),  # nothing to plot
    ("learner-0", {"event": "step", "t": 101.0, "step": 10, "loss": 3.5, "tokens": 1280, "bytes_sent": 900}),
    ("learner-1", {"event": "step", "t": 101.2, "step": 8, "loss": 3.75, "tokens": 1024, "bytes_sent": 700}),
    ("learner-1.p1", {"event": "step", "t": 101.2, "step": 8, "loss": 9.0, "tokens": 1024, "bytes_sent": 0}),
    ("learner-0", {"event": "step", "t": 103.0, "step": 20, "loss": 3.0, "tokens": 2560, "bytes_sent": 1800}),
    ("learner-0", {"event": "link", "t": 103.1, "step": 20, "rate_gbit_s": 2.5, "rtt_ms": 40.0}),
    ("syncer", {"event": "progress", "t": 103.2, "global_step": 20, "versions": [3, 4], "mean_quorum": 1.5,
                "bytes_in": 1e6, "bytes_out": 2e6, "recovery_bytes": 0}),
    ("syncer", {"event": "progress", "t": 103.4, "global_step": 20, "versions": [3, 4], "mean_quorum": 1.5,
                "bytes_in": 1e6, "bytes_out": 2e6, "recovery_bytes": 0}),  # same step: no second row
    ("learner-1", {"event": "eval", "t": 103.5, "step": 20, "eval_loss": 2.75, "tokens": 5000}),
    ("learner-0", {"event": "final", "t": 104.0, "steps": 24, "tokens": 3072, "compute_s": 3.0, "train_s": 4.0,
                   "merge_lag_steps": 3.0, "final_eval_loss": 2.5}),
    ("learner-1", {"event": "final", "t": 104.1, "steps": 24, "tokens": 3072, "compute_s": 1.0, "train_s": 4.0,
                   "merge_lag_steps": None, "final_eval_loss": 2.5}),
    ("syncer", {"event": "final", "t": 104.5, "global_step": 24, "versions": [4, 4], "mean_quorum": 2.0,
                "bytes_in": 3e6, "bytes_out": 4e6, "recovery_bytes": 10}),
]

# name -> [(step, value)] that every tracker must end up with.
EXPECTED = {
    "learner/0/loss": [(10, 3.5), (20, 3.0)],
    "learner/1/loss": [(8, 3.75)],
    "learner/0/tokens_per_s": [(20, 640.0)],  # (2560 - 1280) tokens in 2 s
    "learner/0/bytes_sent": [(10, 900.0), (20, 1800.0)],
    "learner/0/link_gbit_s": [(20, 2.5)],
    "learner/0/link_rtt_ms": [(20, 40.0)],
    "eval/loss": [(20, 2.75)],
    "eval/final_loss": [(24, 2.5), (24, 2.5)],
    "learner/0/merge_lag_steps": [(24, 3.0)],
    "learner/0/goodput": [(24, 0.75)],
    "learner/1/goodput": [(24, 0.25)],
    "run/goodput": [(24, 0.75), (24, 0.5)],
    "syncer/mean_quorum": [(0, 0.0), (20, 1.5), (24, 2.0)],
    "syncer/bytes_in": [(0, 0.0), (20, 1e6), (24, 3e6)],
    "syncer/bytes_out": [(0, 0.0), (20, 2e6), (24, 4e6)],
    "syncer/recovery_bytes": [(0, 0.0), (20, 0.0), (24, 10.0)],
    "syncer/versions": [(0, 0.0), (20, 7.0), (24, 8.0)],
    "learner/0/tokens": [(10, 1280.0), (20, 2560.0)],
    "learner/1/tokens": [(8, 1024.0)],
    "learner/1/bytes_sent": [(8, 700.0)],
}


def config(*names, **run):
    return spec_lib.from_document({"run": {"trackers": list(names), "token": TOKEN, "learners": 2, **run}})


def feed(cfg, rdir, events=EVENTS):
    log = Trackers(cfg, rdir)
    warnings = [w for source, e in events for w in log.write(source, e)]
    log.close()
    return log, warnings + log.write("", {})  # and what the trackers' thread said after the last event


def by_name(points):
    """[(name, step, value)] -> {name: [(step, value)]} in the order they came."""
    out = {}
    for name, step, value in points:
        out.setdefault(name, []).append((step, round(value, 4)))
    return out


def test_events_become_the_same_rows_for_every_tracker():
    scalars = EventScalars()
    got = [(n, step, v) for s, e in EVENTS if (row := scalars.row(s, e)) for n, v in row[2].items()
           for step in [row[1]]]
    assert by_name(got) == EXPECTED
    # a learner's restart counts tokens from zero: no rate across it, and the next report has one again
    assert "learner/0/tokens_per_s" not in scalars.row("learner-0", {"event": "step", "t": 110.0, "step": 30,
                                                                     "loss": 2.0, "tokens": 128})[2]
    assert scalars.row("learner-0", {"event": "step", "t": 111.0, "step": 31, "loss": 2.0,
                                     "tokens": 256})[2]["learner/0/tokens_per_s"] == 128.0


def read_tensorboard(logdir):
    from tensorboardX.proto import event_pb2

    found = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):  # TFRecord: length, its CRC, the record, its CRC
            (n,) = struct.unpack_from("<Q", data, at)
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return by_name(found)


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboardX")
    log, warnings = feed(config("tensorboard"), tmp_path)
    assert warnings == [] and log.where == {"tensorboard": str(tmp_path / "tensorboard")}
    assert read_tensorboard(tmp_path / "tensorboard") == EXPECTED


def read_wandb(path):
    """The records of a .wandb file (LevelDB log blocks of W&B's protobuf Records), with W&B's own protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    at, part, records = 7, b"", []
    while at + 7 <= len(data):
        room = 32768 - at % 32768
        _, n, kind = struct.unpack_from("<IHB", data, at)
        if room < 7 or (n == 0 and kind == 0):  # a block's zero trailer
            at += room
            continue
        part += data[at + 7:at + 7 + n]
        at += 7 + n
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return records


@pytest.fixture
def wandb_offline(monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "wdl-test")
    yield
    wandb.teardown()  # its service process, so no process is left behind


def test_wandb_offline_run_read_back(tmp_path, wandb_offline):
    import wandb

    rdir = tmp_path / "20260101-120000"
    log, warnings = feed(config("wandb"), rdir)
    wandb.teardown()  # W&B's service writes the run's file after finish() returned: once it is gone, all is there
    assert warnings == []
    files = list(rdir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1 and log.where == {"wandb": str(files[0].parent)}
    records = read_wandb(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == rdir.name and run.project == "wdl-test"
    assert json.loads((rdir / "trackers.json").read_text()) == {"wandb": run.run_id}
    conf = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert conf["run.learners"] == 2 and conf["run.trackers"] == ["wandb"]
    assert "run.token" not in conf and TOKEN not in files[0].read_bytes().decode("latin-1")
    points = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {"".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            points += [(k, row["global_step"], v) for k, v in row.items() if not k.startswith("_") and k != "global_step"]
    assert by_name(points) == EXPECTED
    # each row plotted against the global step, not W&B's own counter
    metrics = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in records
               if r.WhichOneof("record_type") == "metric"}
    assert metrics.get("*") == "global_step"


@pytest.fixture
def mlflow_client():
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    return MlflowClient


def test_mlflow_run_read_back_and_resumed_in_the_same_run(tmp_path, monkeypatch, mlflow_client):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    rdir = tmp_path / "run-a"
    cfg = config("mlflow")
    first, second = EVENTS[:6], EVENTS[6:]
    log, warnings = feed(cfg, rdir, first)
    assert warnings == []
    run_id = json.loads((rdir / "trackers.json").read_text())["mlflow"]
    uri = f"sqlite:///{(rdir / 'mlflow.db').resolve()}"
    assert log.where == {"mlflow": f"{uri} (run {run_id})"}
    _, warnings = feed(cfg, rdir, second)  # launch --resume: the same folder, the same run
    assert warnings == []
    client = mlflow_client(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "wan-diloco"
    params = run.data.params
    assert params["run.learners"] == "2" and params["model.preset"] == "tiny" and "run.token" not in params
    assert params == {k: str(v) for k, v in trackers.flat_config(cfg).items()}
    got = {name: sorted((m.step, round(m.value, 4)) for m in client.get_metric_history(run_id, name))
           for name in run.data.metrics}
    # the scalars split over the two launches add up to what one launch gets (first the run's own rows)
    scalars = EventScalars()
    expected = by_name([(n, row[1], v) for s, e in first + second if (row := scalars.row(s, e))
                        for n, v in row[2].items()])
    assert got == {k: sorted(v) for k, v in expected.items()}


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(tmp_path, monkeypatch, mlflow_client):
    pytest.importorskip("tensorboardX")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")  # refused at once, nothing fetched
    log, warnings = feed(config("mlflow", "tensorboard"), tmp_path, EVENTS[:1])
    assert len(warnings) == 1, warnings
    assert warnings[0]["event"] == "warning" and warnings[0]["what"].startswith("tracker mlflow: ")
    assert "the run goes on" in warnings[0]["what"] and "\n" not in warnings[0]["what"]
    assert "mlflow" not in log.where and read_tensorboard(tmp_path / "tensorboard")["syncer/versions"] == [(0, 0.0)]


def test_unknown_or_repeated_tracker_is_a_load_error():
    with pytest.raises(ConfigError, match=r"^run.trackers\[1\]: must be one of 'tensorboard', 'wandb', 'mlflow', "
                                          r"got 'neptune'$"):
        config("wandb", "neptune")
    with pytest.raises(ConfigError, match=r"^run.trackers: names a tracker twice"):
        config("mlflow", "mlflow")
    with pytest.raises(ConfigError, match=r"^run.tensorboard: must be true or false, got 'yes'$"):
        spec_lib.from_document({"run": {"tensorboard": "yes"}})


def test_tensorboard_true_still_means_the_tensorboard_tracker():
    doc = {"run": {"tensorboard": True, "trackers": ["wandb"]}}
    cfg = spec_lib.from_document(doc)
    assert cfg.run.trackers == ("wandb", "tensorboard")
    assert spec_lib.from_document({"run": {"tensorboard": False}}).run.trackers == ()
    # the run's own config.toml says it the new way, and reads back the same
    assert spec_lib.from_document(spec_lib.to_document(cfg)).run.trackers == ("wandb", "tensorboard")


def test_a_missing_package_names_the_extra(monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    trackers.check_installed(("tensorboard",) if real("tensorboardX") else ())
    with pytest.raises(ConfigError, match=r"^run.trackers: 'wandb' needs the wandb package: "
                                          r"pip install 'wan-diloco\[wandb\]'$"):
        trackers.check_installed(("wandb",))
    # MLflow's local store (RUN_DIR/mlflow.db) needs SQLAlchemy: said at the start, not as a failure later
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "sqlalchemy" else real(name))
    with pytest.raises(ConfigError, match=r"^run.trackers: 'mlflow' needs the sqlalchemy package: "
                                          r"pip install 'wan-diloco\[mlflow\]'$"):
        trackers.check_installed(("wandb", "mlflow"))


def test_wandb_without_a_login_is_a_warning_not_a_prompt(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: no stored key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    try:
        log, warnings = feed(config("wandb"), tmp_path / "run", EVENTS[:1])
    finally:
        wandb.teardown()
    assert [w["what"] for w in warnings] == [
        "tracker wandb: RuntimeError: no W&B login: run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline; "
        "it gets nothing more, the run goes on"]
    assert log.where == {} and not (tmp_path / "run" / "wandb").exists()
