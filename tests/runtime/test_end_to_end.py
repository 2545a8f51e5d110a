"""1 syncer + 3 learners on loopback through `launch`: after the final sync every copy is bit-identical."""
import importlib.util
import json
import socket

import pytest

from wan_diloco import spec as rt
from wan_diloco.runtime.launch import launch
from wan_diloco.runtime.trackers import PACKAGES

from .conftest import micro_config


@pytest.mark.parametrize("bits", [32, 4])
def test_three_learners_end_bit_identical_to_the_syncer(tmp_path, bits, monkeypatch):
    extra = f"\n[codec]\nbits = {bits}\n" if bits != 32 else ""
    # Paced: 40 unpaced micro steps take 0.5 s, less than the spread of three learners' start-ups on two
    # loaded cores, and a learner that trains the whole run alone leaves nothing to merge along the way.
    path = micro_config(tmp_path, learners=3, steps=40, min_step_s=0.05, extra=extra)
    path.write_text(path.read_text().replace("[run]\n", "[run]\neval_every_steps = 10\n"))
    if bits == 32:  # and the experiment trackers beside metrics.jsonl (W&B offline; MLflow where its env says)
        trackers = [t for t, (modules, _) in PACKAGES.items() if all(map(importlib.util.find_spec, modules))]
        path.write_text(path.read_text().replace("[run]\n", f"[run]\ntrackers = {json.dumps(trackers)}\n"))
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the quick store for a test (it is deprecated)
    if bits == 4:  # and each learner with its own token (#13): launch hands each only its own
        path.write_text(path.read_text().replace("[transport]\n", "[transport]\nper_learner_tokens = true\n"))
    code, summary = launch(rt.load(path), path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    syncer = next(e for e in events if e["source"] == "syncer" and e["event"] == "final")
    finals = {e["learner"]: e for e in events if e["source"].startswith("learner") and e["event"] == "final"}
    assert sorted(finals) == [0, 1, 2] and summary["bit_identical"]
    # The start barrier (launch: every learner): no learner started training before all three had joined.
    met = next(e for e in events if e["source"] == "syncer" and e["event"] == "barrier")
    assert met["joined"] == [0, 1, 2] and all(e["t"] >= met["t"] - 0.05 for e in events if e["event"] == "start")
    for f in finals.values():
        assert f["digests"] == syncer["digests"]  # the learner's global fragments
        assert f["param_digests"] == syncer["digests"]  # alpha = 0: its model is the global one
        assert f["versions"] == syncer["versions"]
    # Fragments synced during the run, and the final merge reached some learner by broadcast, not bulk.
    assert all(n >= 1 for n in syncer["fragment_syncs"]) and syncer["mean_quorum"] >= 1
    assert sum(f["final_by_bulk"] for f in finals.values()) < 3 * len(syncer["versions"])
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert 0 < summary["bytes_sent"] < summary["dp_bytes"]
    # run.eval_every_steps: the global model's loss every 10 steps, learner (step / 10) mod 3 in turn (a learner
    # that joined late, past its turn's step, skips that point).
    evals = [e for e in events if e["event"] == "eval"]
    turns = {(10, 1), (20, 2), (30, 0), (40, 1)}
    assert len(evals) >= 2 and all((e["step"], e["learner"]) in turns for e in evals), evals
    # In step order (learners' events interleave in the file as they arrive).
    assert summary["eval_curve"] == sorted(({k: e[k] for k in ("step", "eval_loss", "tokens")} for e in evals),
                                           key=lambda x: x["step"])
    # A point taken after merges reached its learner is the trained global model (on a loaded machine the
    # first points may come before any merge: the initial model, exactly).
    assert all(e["eval_loss"] < summary["initial_eval_loss"] for e in evals if sum(e["versions"]) > 0), evals
    assert all(e["eval_loss"] <= summary["initial_eval_loss"] for e in evals), evals
    assert (tmp_path / "run" / "loss.png").read_bytes().startswith(b"\x89PNG")
    if bits == 32:
        check_trackers(tmp_path / "run", trackers, summary, evals)
    if bits == 4:
        assert summary["compression_ratio"] > 5  # NF4 + scales + zstd on the fragment traffic


def check_trackers(rdir, trackers, summary, evals):
    """Each tracker of the run has every learner's loss and the global model's eval points."""
    from .test_trackers import read_tensorboard, read_wandb

    points = sorted((e["step"], round(e["eval_loss"], 4)) for e in evals)
    assert sorted(summary["trackers"]) == sorted(trackers)
    if "tensorboard" in trackers:
        scalars = read_tensorboard(rdir / "tensorboard")
        assert {"learner/0/loss", "learner/2/loss", "syncer/versions", "learner/1/goodput"} <= set(scalars)
        assert sorted(scalars["eval/loss"]) == points
    if "wandb" in trackers:
        import wandb

        wandb.teardown()  # its service: no process left behind, and the run's file written out
        (path,) = (rdir / "wandb").glob("offline-run-*/run-*.wandb")
        rows = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
                for r in read_wandb(path) if r.WhichOneof("record_type") == "history"]
        assert {"learner/0/loss", "learner/2/tokens_per_s", "syncer/bytes_in"} <= {k for row in rows for k in row}
        assert sorted((r["global_step"], round(r["eval/loss"], 4)) for r in rows if "eval/loss" in r) == points
    if "mlflow" in trackers:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()  # MLFLOW_TRACKING_URI: the run logged where the environment said
        run = client.get_run(json.loads((rdir / "trackers.json").read_text())["mlflow"])
        assert run.data.params["run.learners"] == "3" and run.info.run_name == rdir.name
        history = client.get_metric_history(run.info.run_id, "eval/loss")
        assert sorted((m.step, round(m.value, 4)) for m in history) == points


def test_launch_fails_with_the_reason_when_the_syncer_cannot_start(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = micro_config(tmp_path, learners=1)
        text = path.read_text().replace("[run]\n", f"[run]\nport = {port}\n")
        path.write_text(text)
        code, summary = launch(rt.load(path), text, str(tmp_path / "run"))
    assert code == 1
    assert "syncer exited with code" in summary["error"]
