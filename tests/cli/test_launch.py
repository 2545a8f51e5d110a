"""`wan-diloco launch` options that shape the run before any process starts (the run itself: tests/runtime)."""
import tomllib
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.cli import launch as launch_cli
from wan_diloco.cli import main

LOCAL = str(Path(__file__).resolve().parents[2] / "examples" / "local.toml")


def _capture(monkeypatch):
    seen = {}

    def fake_launch(cfg, text, run_dir, view, emulate=False, every_s=None):
        seen.update(cfg=cfg, text=text)
        return 1, {"error": "not run in this test"}
    monkeypatch.setattr(launch_cli, "launch_and_show", fake_launch)
    return seen


def test_launch_with_plan_runs_the_planned_settings(monkeypatch, capsys):
    seen = _capture(monkeypatch)
    assert main(["launch", "--config", LOCAL, "--plan", "--step-time", "0.1", "--quiet"]) == 1
    cfg = seen["cfg"]
    # What `wan-diloco plan --step-time 0.1` picks for the local example (tests/cli/test_plan.py).
    assert (cfg.learner.sync_every, cfg.learner.num_fragments, cfg.learner.tau, cfg.codec.bits) == (10, 4, 1, 16)
    assert cfg.syncer.max_grace_s is not None and cfg.syncer.max_grace_s > 0
    # Every process reads the text: it must carry the same settings.
    assert spec_lib.from_document(tomllib.loads(seen["text"])) == cfg
    out = capsys.readouterr().out
    assert "predicted CU" in out and "sync_every = 10" in out


def test_launch_without_plan_runs_the_file_as_written(monkeypatch):
    seen = _capture(monkeypatch)
    main(["launch", "--config", LOCAL, "--quiet"])
    assert seen["cfg"] == spec_lib.load(LOCAL) and seen["text"] == Path(LOCAL).read_text()


def test_plan_inputs_without_plan_are_refused(monkeypatch, capsys):
    seen = _capture(monkeypatch)
    assert main(["launch", "--config", LOCAL, "--step-time", "0.1", "--quiet"]) == 2
    assert not seen and "go with --plan" in capsys.readouterr().err


def test_a_config_every_process_would_die_of_is_one_line_before_any_starts(tmp_path, capsys):
    # Before: each learner died on its own ("every learner died (learner-0: 2, ...)") after ~30 s of start-up.
    missing = tmp_path / "missing.txt"
    for old, new, message in (
            ("num_fragments = 4 ", "num_fragments = 64 ", "learner.num_fragments: 64 leaves fragments"),
            ('corpus = "stdlib"', f'corpus = "{missing}"', f"data.corpus: {missing}: no such file")):
        path = tmp_path / "run.toml"
        path.write_text(Path(LOCAL).read_text().replace(old, new))
        try:
            code = main(["launch", "--config", str(path), "--run-dir", str(tmp_path / "run"), "--quiet"])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("wan-diloco launch: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_the_live_table_in_an_80_column_terminal_keeps_names_and_figures_whole():
    # Before: "learne…" and "12.3\nMB" in every row of an 80-column terminal.
    import io

    from rich.console import Console

    from wan_diloco.runtime.launch import RunState

    state = RunState(spec_lib.load(LOCAL))
    for m in range(4):
        state.fold(f"learner-{m}", {"event": "step", "step": 123, "loss": 3.21, "tokens": 123_456,
                                    "bytes_sent": 12_345_678})
        state.fold(f"learner-{m}", {"event": "link", "rtt_ms": 41.0, "rate_gbit_s": 2.5})
    term = io.StringIO()
    Console(file=term, width=80).print(launch_cli.table(state))
    text = term.getvalue()
    assert all(f"│ learner-{m} │" in text for m in range(4)) and text.count("12.3 MB") == 4, text
