"""A standalone syncer or learner watched by a person: the live table `launch` shows, a summary at the end,
and the JSON events in a file rather than on the terminal."""
import io
import json

from rich.console import Console

from wan_diloco import spec
from wan_diloco.cli import live, main
from wan_diloco.runtime.events import emit

from tests.conftest import write_micro


def write_config(tmp_path):
    return write_micro(tmp_path / "run.toml", run={"learners": 2, "token": "live-test-token-0123456"},
                      transport={"retry_budget_s": 1.0, "backoff_initial_s": 0.2})


def view_of(tmp_path, name):
    write_config(tmp_path)
    cfg = spec.load(tmp_path / "run.toml")
    term = io.StringIO()
    return live.ProcessView(cfg, name, tmp_path / "ev" / f"{name}.jsonl",
                            Console(file=term, force_terminal=True, width=160)), term


def rendered(table) -> str:
    term = io.StringIO()
    Console(file=term, width=160).print(table)
    return term.getvalue()


def test_a_learner_shows_its_row_and_its_summary_and_keeps_its_events(tmp_path, capsys):
    view, term = view_of(tmp_path, "learner-1")
    with view:
        emit({"event": "start", "role": "learner", "learner": 1, "step": 0, "eval_loss": 5.5})
        emit({"event": "step", "role": "learner", "learner": 1, "step": 17, "loss": 3.25, "tokens": 2176,
              "bytes_sent": 4096})
        row = rendered(view._render())
        emit({"event": "final", "role": "learner", "learner": 1, "steps": 40, "tokens": 5120, "train_s": 8.0,
              "compute_s": 6.0, "last_loss": 2.4, "initial_eval_loss": 5.5, "final_eval_loss": 2.3, "bytes_sent": 10_000,
              "bytes_received": 20_000, "raw_bytes": 800, "payload_bytes": 200, "resyncs": 0, "rejoins": 1,
              "digest_mismatch": []})
    assert "learner-1" in row and "17" in row and "3.250" in row and "training" in row
    assert "learner-0" not in row  # a standalone learner shows its own row
    assert capsys.readouterr().out == ""  # no JSON on the terminal
    lines = [json.loads(x) for x in view.path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["start", "step", "final"] and all(e["source"] == "learner-1" for e in lines)
    summary = term.getvalue()
    assert "5.5000 -> 2.3000" in summary and "4.00x" in summary and "equal the syncer's" in summary
    assert str(view.path) in summary
    emit({"event": "after", "role": "learner"})  # the view closed: events are stdout's again
    assert json.loads(capsys.readouterr().out)["event"] == "after"


def test_a_syncer_shows_its_learners_as_their_metadata_says(tmp_path):
    view, term = view_of(tmp_path, "syncer")
    status = {"learners": {"0": {"step": 120, "alive": True}, "1": {"step": 80, "alive": False}},
              "links": {"learner-0": {"rtt_ms": 41.0, "rate_gbit_s": 2.5, "age_s": 1.0}}}
    with view:
        view.watch_syncer(status, {0: {"loss": 2.75, "tokens": 9000}})
        table = rendered(view._render())
        emit({"event": "final", "role": "syncer", "global_step": 400, "fragment_syncs": [50, 50], "mean_quorum": 1.5,
              "late_carried": 2, "final_learners": [0, 1], "bytes_in": 1e6, "bytes_out": 2e6, "snapshots_complete": 3,
              "run_id": "r-1", "epoch": 1, "params_path": "/x/params.safetensors"})
    assert "120" in table and "2.750" in table and "9,000" in table and "2.5 Gbit/s 41 ms" in table
    assert "lost" in table and "learner-1" in table
    summary = term.getvalue()
    assert "50 50" in summary and "/x/params.safetensors" in summary and "3 (r-1, 1)" in summary


def test_a_standalone_learner_that_cannot_reach_its_syncer_says_why_in_its_summary(tmp_path, capsys):
    write_config(tmp_path)
    events = tmp_path / "l0.jsonl"
    code = main(["learner", "--config", str(tmp_path / "run.toml"), "--id", "0", "--syncer", "127.0.0.1:9",
                 "--table", "--events", str(events)])
    assert code == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert "cannot reach the syncer at 127.0.0.1:9" in err and "refused" in err  # the summary says why
    error = [json.loads(x) for x in events.read_text().splitlines() if '"error"' in x]
    assert error and "127.0.0.1:9" in error[-1]["error"]


def test_a_syncer_shows_a_learner_it_never_heard_from_as_not_seen_not_lost(tmp_path):
    # Case 10 of #23: a learner that never connected was shown "lost" once the liveness check gave up on it.
    view, _ = view_of(tmp_path, "syncer")
    status = {"learners": {"0": {"step": 9, "alive": False, "state": "quarantined"},
                           "1": {"step": 0, "alive": False, "state": "waiting"}}}
    with view:
        view.watch_syncer(status, {})
        rows = {m: view.mon.learners[m]["status"] for m in (0, 1)}
    assert rows == {0: "quarantined", 1: "not seen"}


def test_a_plain_standalone_learner_keeps_its_json_on_stdout_and_says_why_it_ended_on_stderr(tmp_path, capsys):
    # Under a scheduler: the JSON events where a collector reads them, the summary as lines beside them.
    write_config(tmp_path)
    code = main(["learner", "--config", str(tmp_path / "run.toml"), "--id", "0", "--syncer", "127.0.0.1:9",
                 "--plain"])
    assert code == 3
    out, err = capsys.readouterr()
    said = [json.loads(x) for x in out.splitlines()]
    assert said[-1]["event"] == "error" and "127.0.0.1:9" in said[-1]["error"] and "source" not in said[-1]
    summary = err[err.index("learner-0: summary:\n"):].splitlines()
    assert summary[1].startswith("  ended: ") and "cannot reach the syncer at 127.0.0.1:9" in summary[1]
    assert summary[2] == "  events: on stdout"
