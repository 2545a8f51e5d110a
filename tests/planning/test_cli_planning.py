import json

import pytest

from wan_diloco.cli import main
from wan_diloco.planning.bandwidth import METHODS
from wan_diloco.planning.tape import load_tape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bandwidth_json_has_the_issue_schema(tmp_path, capsys):
    out, png = tmp_path / "bw.json", tmp_path / "bw.png"
    assert main(["bandwidth", "--preset", "1b", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"cu_targets", "methods"}
    assert data["cu_targets"] == [0.5, 0.8, 0.9, 0.95, 0.99]
    assert tuple(data["methods"]) == METHODS and METHODS[-1] == "decoupled"
    for rates in data["methods"].values():
        assert len(rates) == 5 and rates == sorted(rates)
    assert png.read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert "streaming_overlap_4bit" in printed and "\n│ decoupled " in printed
    assert f"plot: {png}" in printed.replace("\n", "")  # rich may wrap a long path
    assert "CU = compute utilization" in printed


def test_a_bare_bandwidth_answers_for_a_default_model_and_says_which(capsys):
    assert main(["bandwidth"]) == 0
    printed = capsys.readouterr().out
    assert "--preset 1b" in printed and "1e+09 params, 24 layers" in printed and "│ decoupled " in printed


def test_bandwidth_reports_cu_at_a_given_rate(tmp_path):
    out = tmp_path / "bw.json"
    argv = ["bandwidth", "--params", "1e9", "--layers", "24", "--step-time", "0.1", "--method", "diloco,decoupled",
            "--target-cu", "0.9", "--bandwidth-gbit", "10", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert list(data["methods"]) == ["diloco", "decoupled"]
    assert set(data["cu_at_bandwidth"]["cu"]) == {"diloco", "decoupled"}


def test_bandwidth_recommend_mode_names_its_pick_and_plots_it(tmp_path, capsys):
    out, png = tmp_path / "rec.json", tmp_path / "rec.png"
    argv = ["bandwidth", "--link-gbit", "2.5", "--rtt-ms", "60", "--target-cu", "0.95", "--params", "1e10",
            "--layers", "48", "--step-time", "0.8", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["reached"] and data["recommendations"][0]["cu"] >= 0.95
    assert set(data["recommendations"][0]) == {"sync_every", "fragments", "tau", "bits", "cu", "quality"}
    pick = data["pick"]
    assert pick == {k: v for k, v in data["recommendations"][0].items() if k != "quality"}
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    setting = f"H = {pick['sync_every']}, P = {pick['fragments']}, tau = {pick['tau']}, {pick['bits']}-bit"
    assert "given: 1e+10 params, 48 layers" in printed and "H=100, P=16, tau=1" in printed
    assert f"recommended: {setting}: CU" in printed
    assert "cost model quality). Model quality: as data parallel in published runs." in printed
    assert ". as data parallel" not in printed  # was a stray fragment after the sentence
    assert png.read_bytes().startswith(PNG_MAGIC)  # --plot used to be ignored in this mode


def test_bandwidth_recommend_mode_says_when_nothing_reaches_the_target(tmp_path, capsys):
    out = tmp_path / "rec.json"
    argv = ["bandwidth", "--link-gbit", "0.001", "--target-cu", "0.99", "--preset", "10b", "--json", str(out)]
    assert main(argv) == 1
    assert "no setting reaches CU 0.99 on 0.001 Gbit/s" in capsys.readouterr().out
    assert json.loads(out.read_text())["pick"] is None


@pytest.mark.parametrize(
    "argv, field",
    [(["--preset", "1b", "--target-cu", "1.5"], "target_cu"),
     (["--layers", "24", "--step-time", "0.1"], "params"),
     (["--params", "1e9", "--layers", "24"], "step_time"),
     (["--preset", "1b", "--method", "ring"], "method"),
     (["--preset", "1b", "--link-gbit", "2", "--target-cu", "0.9,0.95"], "target_cu")],
)
def test_bandwidth_bad_input_exits_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bandwidth", *argv])
    assert e.value.code == 2
    assert f"error: {field}:" in capsys.readouterr().err


def test_goodput_json_tape_and_plot(tmp_path):
    out, tape, png = tmp_path / "g.json", tmp_path / "tape.json", tmp_path / "g.png"
    common = ["goodput", "--chips", "1e5", "--system", "decoupled", "--learners", "4", "--days", "1"]
    assert main([*common, "--json", str(out), "--tape", str(tape)]) == 0
    data = json.loads(out.read_text())
    assert 0 < data["goodput"] <= data["uptime"] <= 1 and data["config"]["learners"] == 4
    full = load_tape(tape)
    assert main([*common, "--tape", str(tape), "--time-scale", "0.001", "--plot", str(png)]) == 0
    scaled = load_tape(tape)
    assert len(scaled) == len(full)
    assert [o.up_at for o in scaled] == pytest.approx([o.up_at * 0.001 for o in full])
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_goodput_bad_input_exits_naming_the_field(capsys):
    with pytest.raises(SystemExit) as e:
        main(["goodput", "--system", "decoupled", "--learners", "2", "--quorum", "3"])
    assert e.value.code == 2
    assert "error: quorum:" in capsys.readouterr().err


def test_goodput_plots_a_small_cluster_too_and_keeps_the_tape(tmp_path, capsys):
    # 2,048 chips used to be refused ("needs --chips above 16384"), and --tape was lost with it.
    tape, png = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["goodput", "--chips", "2048", "--slice-chips", "256", "--days", "1", "--tape", str(tape),
                 "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC) and tape.exists()
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"plot: {png}" in printed and f"-> {tape}" in printed


def test_goodput_by_default_sets_decoupled_beside_data_parallel(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["goodput", "--chips", "2048", "--slice-chips", "256", "--days", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decoupled, M=4, K=1" in printed and "elastic-dp" in printed and "│ goodput " in printed
    systems = json.loads(out.read_text())["systems"]
    assert [s["config"]["system"] for s in systems] == ["dp", "elastic-dp", "decoupled"]
    assert [s["config"]["learners"] for s in systems] == [1, 1, 4]  # the default run's M, not 1
    assert systems[2]["uptime"] >= systems[1]["uptime"]


def test_goodput_learners_of_decoupled_alone_and_a_single_systems_json(tmp_path):
    out = tmp_path / "g.json"
    assert main(["goodput", "--chips", "2048", "--system", "decoupled", "--days", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["learners"] == 4
    assert main(["goodput", "--chips", "2048", "--system", "dp", "--days", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["learners"] == 1
