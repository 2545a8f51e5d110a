"""Output for a log file or CI: the progress line, its rate and ETA, and summaries no terminal width cuts."""
import io
import json
import re
import time

import pytest
from rich.console import Console

from wan_diloco.cli import build_parser, live, main, progress
from wan_diloco.cli import launch as launch_cli
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.launch import RunState

from tests.conftest import micro_spec

LONG = "/data/" + "/".join(["a-rather-long-folder-name"] * 6) + "/checkpoints/params.safetensors"
KEYS = ["elapsed_s", "step", "tokens", "tokens_per_s", "eval_loss", "up", "down", "quorum", "learners", "final_sync",
        "eta_s"]


def keys_and_values(line):
    words = line.split(" ")
    pairs = [w.split("=", 1) for w in words if "=" in w]
    return " ".join(w for w in words if "=" not in w), dict(pairs), [k for k, _ in pairs]


def test_a_progress_line_has_the_same_keys_in_the_same_order_known_or_not():
    known = progress.Progress(step=120, budget_steps=300, tokens=45_000, learners_training=3, learners=4,
                              eval_loss=3.21456, eval_step=100, up_bytes=1_234_000, down_bytes=5_600_000,
                              mean_quorum=2.5, learners_final_sync=1)
    _, got, order = keys_and_values(progress.progress_line(known, 65.4, 2345.6, 97.2))
    assert order == KEYS
    assert got == {"elapsed_s": "65", "step": "120/300", "tokens": "45000", "tokens_per_s": "2346",
                   "eval_loss": "3.2146@100", "up": "1.2MB", "down": "5.6MB", "quorum": "2.50", "learners": "3/4",
                   "final_sync": "1", "eta_s": "97"}
    unknown = progress.Progress(step=0, budget_steps=300, tokens=0, learners_training=0, learners=4)
    prefix, got, order = keys_and_values(progress.progress_line(unknown, 3.0, None, None, prefix="syncer progress"))
    assert prefix == "syncer progress" and order == KEYS
    assert got["eval_loss"] == got["quorum"] == got["eta_s"] == got["tokens_per_s"] == "-"


def test_figures_read_a_runs_state_as_its_events_left_it():
    mon = RunState(micro_spec(run={"learners": 2, "steps": 40}))
    mon.fold("learner-0", {"event": "start", "step": 0, "eval_loss": 5.5})
    mon.fold("learner-1", {"event": "start", "step": 0, "eval_loss": 5.7})
    before = progress.figures(mon)
    assert (before.eval_loss, before.eval_step, before.learners_training) == (5.5, 0, 2)  # the model they began from
    mon.fold("learner-0", {"event": "step", "step": 17, "loss": 3.2, "tokens": 1000, "bytes_sent": 10,
                           "bytes_received": 20})
    mon.fold("learner-1", {"event": "step", "step": 15, "loss": 3.3, "tokens": 900, "bytes_sent": 5,
                           "bytes_received": 7})
    assert (progress.figures(mon).up_bytes, progress.figures(mon).down_bytes) == (15, 27)  # no syncer heard yet
    mon.fold("syncer", {"event": "progress", "global_step": 16, "bytes_in": 4000, "bytes_out": 9000,
                        "mean_quorum": 1.5})
    mon.fold("learner-1", {"event": "eval", "step": 16, "eval_loss": 4.25, "tokens": 1800})
    p = progress.figures(mon)
    assert (p.step, p.budget_steps, p.tokens, p.up_bytes, p.down_bytes, p.mean_quorum) == (17, 40, 1900, 4000, 9000, 1.5)
    assert (p.eval_loss, p.eval_step) == (4.25, 16)


def test_learners_in_their_final_sync_count_as_in_the_run_and_are_counted_apart():
    mon = RunState(micro_spec(run={"learners": 3, "steps": 40}))
    for m in range(3):
        mon.fold(f"learner-{m}", {"event": "start", "step": 0, "eval_loss": 5.5})
    mon.fold("learner-0", {"event": "finishing", "step": 40})
    mon.fold("learner-1", {"event": "finishing", "step": 40})
    _, got, _ = keys_and_values(progress.progress_line(progress.figures(mon), 30.0, None, None))
    assert (got["learners"], got["final_sync"]) == ("3/3", "2")  # not 1/3: two are syncing their last fragments
    mon.fold("learner-2", {"event": "exit", "code": 1})
    mon.fold("learner-0", {"event": "final", "steps": 40, "last_loss": 3.0, "tokens": 900, "bytes_sent": 5})
    p = progress.figures(mon)
    assert (p.learners_training, p.learners_final_sync, p.learners) == (1, 1, 3)  # one done, one died


def test_figures_add_up_the_bytes_of_every_syncer_shard():
    mon = RunState(micro_spec(run={"learners": 2, "run_id": "r-1"}, syncer={"shards": 2}))
    mon.fold("syncer", {"event": "progress", "global_step": 9, "bytes_in": 4000, "bytes_out": 9000, "mean_quorum": 2.0})
    mon.fold("syncer-1", {"event": "progress", "global_step": 11, "bytes_in": 1000, "bytes_out": 3000})
    p = progress.figures(mon)
    assert (p.step, p.up_bytes, p.down_bytes, p.mean_quorum) == (11, 5000, 12000, 2.0)


def test_the_ticker_gives_the_rate_since_the_last_line_and_an_eta_from_the_steps_so_far():
    now, state = [0.0], [progress.Progress(step=0, budget_steps=100, tokens=0, learners_training=0, learners=2)]
    ticker = progress.Ticker(lambda: state[0], lambda line: None, every_s=3600, clock=lambda: now[0])
    with ticker:
        now[0] = 10.0
        assert keys_and_values(ticker.line())[1]["tokens_per_s"] == "-"  # nothing trained yet
        state[0] = progress.Progress(step=10, budget_steps=100, tokens=500, learners_training=2, learners=2)
        now[0] = 20.0
        first = keys_and_values(ticker.line())[1]
        state[0] = progress.Progress(step=30, budget_steps=100, tokens=1500, learners_training=2, learners=2)
        now[0] = 30.0
        second = keys_and_values(ticker.line())[1]
    assert first["tokens_per_s"] == "50" and first["eta_s"] == "-"  # one point of steps: no rate of steps yet
    assert second["tokens_per_s"] == "100" and second["eta_s"] == "35"  # 70 steps left at 2 steps/s
    assert second["elapsed_s"] == "30"


def test_the_ticker_writes_lines_on_its_own_until_closed():
    lines = []
    p = progress.Progress(step=1, budget_steps=2, tokens=3, learners_training=1, learners=1)
    with progress.Ticker(lambda: p, lines.append, every_s=0.05):
        time.sleep(0.3)
    count = len(lines)
    time.sleep(0.15)
    assert count >= 2 and len(lines) == count and all(x.startswith("progress elapsed_s=") for x in lines)


def test_the_launch_summary_in_a_log_keeps_every_cell_whole(capsys):
    summary = {"initial_eval_loss": 5.5, "final_eval_loss": 2.4, "learners_finished": 2, "learners": 2,
               "final_learners": [0, 1], "tokens": 12_345, "global_steps": 40, "goodput": 0.93,
               "fragment_syncs": [2, 3], "mean_quorum": 1.8, "late_carried": 0, "bytes_sent": 2_400_000,
               "dp_bytes": 21e6, "compression_ratio": 1.11, "bit_identical": True, "snapshots": 0, "run_id": "r-1",
               "params_path": LONG, "loss_png": LONG.replace("checkpoints/params.safetensors", "loss.png"),
               "wall_s": 58.1, "per_learner": {"0": {"steps": 40, "tokens": 6000, "finished": True, "status": "done"}}}
    launch_cli.print_summary(summary)
    out = capsys.readouterr().out
    assert f"  final parameters: {LONG}\n" in out  # one line, the whole path: copyable from the log
    assert "  learner-0: steps, tokens: 40, 6,000\n" in out and "…" not in out
    assert max(map(len, out.splitlines())) > 80  # not folded to a terminal's width


def test_a_summary_in_a_terminal_is_still_a_table():
    term = io.StringIO()
    progress.show_rows("run", [("final parameters", "x.safetensors")], Console(file=term, force_terminal=True,
                                                                               width=100))
    assert "┃" in term.getvalue() or "│" in term.getvalue()


def test_a_plain_standalone_view_keeps_the_json_on_stdout_and_writes_lines_to_stderr(tmp_path, capsys):
    cfg = micro_spec(run={"learners": 2})
    err = io.StringIO()
    view = live.ProcessView(cfg, "syncer", None, Console(file=err, width=80), every_s=0.05)
    with view:
        emit({"event": "progress", "role": "syncer", "global_step": 7, "bytes_in": 100, "bytes_out": 200,
              "mean_quorum": 2.0})
        time.sleep(0.2)
        emit({"event": "final", "role": "syncer", "global_step": 40, "fragment_syncs": [2, 3], "mean_quorum": 1.5,
              "late_carried": 0, "final_learners": [0, 1], "bytes_in": 1e6, "bytes_out": 2e6,
              "snapshots_complete": 1, "run_id": "r-1", "epoch": 1, "params_path": LONG})
    stdout = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in stdout] == ["progress", "final"] and "source" not in stdout[0]  # as emit writes them
    said = err.getvalue()
    assert re.search(r"^syncer progress elapsed_s=\d+ step=7/\d+ ", said, re.M)
    assert f"  final parameters: {LONG}\n" in said and "  events: on stdout\n" in said


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "soon"])
def test_a_bad_progress_period_is_one_line_before_anything_runs(bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", "--progress-every-s", bad, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--progress-every-s" in err and bad in err
    assert not (tmp_path / "run").exists()


def test_table_plain_and_quiet_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--config", "x.toml", "--plain", "--table"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_view_follows_stdout_unless_asked(monkeypatch):
    parser = build_parser()
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert launch_cli.view_of(parser.parse_args(["train"])) == "plain"
    assert launch_cli.view_of(parser.parse_args(["train", "--table"])) == "table"
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert launch_cli.view_of(parser.parse_args(["train"])) == "table"
    assert launch_cli.view_of(parser.parse_args(["train", "--quiet"])) == "quiet"
