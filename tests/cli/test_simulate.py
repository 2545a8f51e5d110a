import json

import pytest

from wan_diloco import cli


def test_tokens_flag_takes_scientific_notation(tmp_path):
    from wan_diloco.cli.simulate import add_arguments, spec_from_args
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    spec = spec_from_args(p.parse_args(["--tokens", "2e6", "--learners", "2"]))
    assert spec.simulate.tokens == 2_000_000 and spec.run.learners == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--tokens", "2.5"])


@pytest.mark.parametrize("argv, msg", [(["--learners", "0"], "learners"), (["--speeds", "1,x"], "speeds"),
                                       (["--merge", "median"], "merge"), (["--bits", "7"], "codec.bits")])
def test_cli_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "--quiet", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_simulate_writes_its_result_picture_and_model_and_the_model_evaluates_to_the_loss_it_reported(
        tmp_path, capsys, monkeypatch):
    # One simulation (of a learner down, uneven speeds, no data failover) for every output: each costs a compile.
    from wan_diloco import spec as spec_lib
    from wan_diloco.assemble import Assembly
    from wan_diloco.checkpoint import read_params

    monkeypatch.chdir(tmp_path)  # without --json the result goes to run.run_dir ("runs") and it says where
    tape, params = tmp_path / "tape.json", tmp_path / "params.safetensors"
    tape.write_text(json.dumps([{"learner": 0, "down_at": 1.0, "up_at": 3.0}]))
    short = dict(preset="micro", learners=2, steps=8, sync_every=4, fragments=2, batch_size=4)
    argv = ["simulate", *(w for k, v in short.items() for w in (f"--{k.replace('_', '-')}", str(v))),
            "--speeds", "1,1.2", "--failures", str(tape), "--no-data-failover", "--keep-local",
            "--params-out", str(params)]
    assert cli.main(argv) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    rel = folder.relative_to(tmp_path)
    assert folder.name.startswith("simulate-")
    out = capsys.readouterr().out
    assert "goodput" in out and f"result: {rel / 'simulate.json'}\npicture: {rel / 'simulate.png'}\n" in out
    data = json.loads((folder / "simulate.json").read_text())
    for key in ("initial_eval_loss", "final_eval_loss", "tokens", "goodput", "uptime", "fragment_syncs", "bytes_sent"):
        assert key in data
    assert len(data["fragment_syncs"]) == 2 and data["bytes_sent"] > 0
    assert data["config"]["simulate"]["data_failover"] is False and data["config"]["learner"]["keep_local"] is True
    assert data["config"]["simulate"]["speeds"] == [1.0, 1.2]
    # Its picture beside the JSON: eval loss against tokens and, below, throughput.
    import matplotlib.image

    picture = matplotlib.image.imread(folder / "simulate.png")
    assert picture.shape[0] >= picture.shape[1] and len(data["curve"]) >= 2  # two panels: taller than wide
    reported = data["final_eval_loss"]
    parts = Assembly(spec_lib.from_short(**short))
    loaded, info = read_params(params, like=parts.params0)
    assert info["final_eval_loss"] == reported
    assert parts.evaluate(loaded) == reported  # the same parameters, bit for bit, give the same loss


@pytest.mark.parametrize("baseline", ["decoupled", "dp"])
def test_the_progress_bar_hears_of_every_step_not_only_eval_points(baseline):
    from wan_diloco import sim
    from wan_diloco import spec as spec_lib

    spec = spec_lib.from_short(preset="micro", learners=2, steps=12, sync_every=4, fragments=2, batch_size=4,
                               eval_every=6, baseline=baseline)
    seen, points = [], []
    result = sim.run(spec, [], progress=lambda fraction, point: (
        seen.append((fraction, point["step"], point["eval_loss"])), points.append(dict(point))))
    fractions = [f for f, _, _ in seen]
    assert len(seen) >= 12 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert len({loss for _, _, loss in seen}) <= 4  # the loss moves only at eval points (0, 6, 12 and the end)
    # Each point says which eval its loss is: the curve's point at eval_step, never one from after the step.
    curve = {(p["step"], p["eval_loss"]) for p in result.curve}  # the end may add a second point at the last step
    assert all(p["eval_step"] <= p["step"] and (p["eval_step"], p["eval_loss"]) in curve for p in points), points
    assert any(p["eval_step"] < p["step"] for p in points)  # between eval points the shown loss is an older one


def test_the_bar_shows_at_which_step_its_eval_loss_was_taken(capsys):
    from wan_diloco.cli.report import progress_bar

    with progress_bar("simulate") as update:
        update(0.5, {"step": 9, "eval_loss": 4.25, "eval_step": 6, "tokens": 10})
    err = capsys.readouterr().err
    assert "step 9  eval loss 4.250 (step 6)" in err, err
