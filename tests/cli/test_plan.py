import dataclasses
import json
from pathlib import Path

import pytest

from wan_diloco.cli import main

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "local.toml")
TINY_PARAMS = 853_120  # the tiny preset: 4 blocks of 196,608 + embedding and head of 256 x 128 + norms


def _plan(tmp_path, *extra):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--config", LOCAL, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_plan_of_the_local_example_matches_wan_diloco_bandwidth(tmp_path, capsys):
    rc, data = _plan(tmp_path, "--step-time", "0.1")
    assert rc == 0 and data["reached"]
    assert (data["sync_every"], data["fragments"], data["tau"], data["bits"]) == (10, 4, 1, 16)
    assert data["params"] == TINY_PARAMS and data["layers"] == 4
    assert data["inputs"]["fragment_params_configured"] == [213_376, 213_248, 213_248, 213_248]
    assert data["fragment_params"] == data["inputs"]["fragment_params_configured"]
    assert data["fragment_bytes"] == 213_376 * 2
    # Learners 1 and 3 are in eu-west (2 Gbit/s, 60 ms by default); 0 and 2 share the syncer's us-east LAN.
    assert data["links"] == {"eu-west": {"rate_gbit_s": 2.0, "rtt_s": 0.06}}
    assert data["learners_per_region"] == {"eu-west": 2}
    assert data["inputs"]["link_source"] == {"eu-west": "config"}
    assert data["inputs"]["step_time_from"] == "given" and data["step_time_s"] == 0.1
    assert data["tau_by_region"] == {"eu-west": 1}
    assert data["demand_gbit_s_by_region"]["eu-west"] == pytest.approx(2 * TINY_PARAMS * 16 / (10 * 0.1) / 1e9)
    # The same figure from `wan-diloco bandwidth`: each of the two learners gets 1 Gbit/s of the link.
    bw = tmp_path / "bw.json"
    assert main(["bandwidth", "--params", str(TINY_PARAMS), "--layers", "4", "--step-time", "0.1",
                 "--method", "decoupled", "--sync-every", "10", "--fragments", "4", "--tau", "1", "--bits", "16",
                 "--rtt-ms", "60", "--target-cu", "0.95", "--bandwidth-gbit", "1", "--json", str(bw)]) == 0
    assert data["cu_predicted"] == json.loads(bw.read_text())["cu_at_bandwidth"]["cu"]["decoupled"]
    out = capsys.readouterr().out
    assert "reached" in out and "eu-west" in out and "sync_every = 10" in out
    flat = " ".join(out.split())  # the first CU is the links table's column: what it means is said above it
    assert flat.index("CU = compute utilization") < flat.index("┃ CU")


def test_measured_links_replace_the_config(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    events = [{"source": "learner-1", "event": "link", "region": "eu-west", "rtt_ms": 150.0, "rate_gbit_s": 1.5},
              {"source": "learner-0", "event": "link", "region": "us-east", "rtt_ms": 0.1, "rate_gbit_s": 9.0},
              {"source": "learner-3", "event": "step", "step": 4},
              {"source": "learner-3", "event": "link", "region": "eu-west", "rtt_ms": 150.0, "rate_gbit_s": 0.05}]
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    rc, data = _plan(tmp_path, "--step-time", "0.1", "--measured", str(metrics))
    assert data["links"] == {"eu-west": {"rate_gbit_s": 0.05, "rtt_s": 0.15}}
    assert data["inputs"]["link_source"] == {"eu-west": "measured"}
    assert any("us-east" in n and "syncer" in n for n in data["inputs"]["notes"])
    # 25 Mbit/s per learner. H=10, P=4 at 4 bits: 107 kB, 2 x 0.034 s + 0.15 s = 0.22 s over 0.09 s steps
    # -> tau 3 (any tau < H is the run's; P=2 would need 4, 8 bits 4).
    assert rc == 0 and data["reached"]
    assert (data["sync_every"], data["fragments"], data["tau"], data["bits"]) == (10, 4, 3, 4)
    assert data["tau_by_region"] == {"eu-west": 3}
    out = capsys.readouterr().out
    assert "measured" in out
    # The planned order is not index order: the TOML line says how a run applies it, and a run takes it.
    assert data["fragment_order"] == [1, 0, 2, 3]
    assert "fragment_order = [1, 0, 2, 3]" in " ".join(out.split())
    from wan_diloco import spec as spec_lib
    from wan_diloco.fragments import Schedule
    run = spec_lib.from_document({"learner": {"sync_every": 10, "num_fragments": 4, "tau": 3,
                                              "fragment_order": data["fragment_order"]}})
    sched = Schedule(run.learner.sync_every, run.learner.num_fragments, run.learner.fragment_order)
    assert [sched.due(s) for s in (10, 2, 5, 7)] == [[1], [0], [2], [3]]
    # `launch --plan` applies it (whatever order the file had for its own P).
    from wan_diloco.api import apply_plan
    from wan_diloco.planning.plan import Plan
    fields = {f.name: data[f.name] for f in dataclasses.fields(Plan)}
    planned = Plan(**{**fields, "fragment_order": tuple(data["fragment_order"])})
    applied = apply_plan(run.with_changes(learner={"num_fragments": 2, "fragment_order": [1, 0], "tau": 1}), planned)
    assert applied.learner.fragment_order == (1, 0, 2, 3) and applied.learner.num_fragments == 4
    index_order = dataclasses.replace(planned, fragment_order=(0, 1, 2, 3))
    assert apply_plan(run, index_order).learner.fragment_order == ()


def test_unreachable_target_exits_1_with_why(tmp_path, capsys):
    rc, data = _plan(tmp_path, "--step-time", "0.001", "--target-cu", "0.99")
    assert rc == 1 and not data["reached"] and data["why"]
    assert "eu-west" in data["why"][0]
    assert "not reached" in capsys.readouterr().out


@pytest.mark.parametrize(
    "toml, extra, field",
    [("[model]\npreset = \"huge\"\n", [], "model.preset"),
     ("[learner]\nsync_evry = 8\n", [], "learner.sync_evry"),
     ("[regions]\nnames = [\"us-east\"]\n", [], "regions"),
     ("", ["--measured", "missing.jsonl"], "measured"),
     ("", ["--target-cu", "1.2"], "target_cu"),
     ("", ["--step-time", "0"], "step_time")],
)
def test_bad_input_exits_2_naming_the_field(tmp_path, capsys, toml, extra, field):
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(cfg), "--step-time", "0.1", *extra])
    assert e.value.code == 2
    assert f"error: {field}:" in capsys.readouterr().err


def test_measured_region_unknown_to_the_config_is_an_error(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "link", "region": "mars", "rtt_ms": 1.0, "rate_gbit_s": 1.0}) + "\n")
    with pytest.raises(SystemExit):
        main(["plan", "--config", LOCAL, "--step-time", "0.1", "--measured", str(metrics)])
    assert "'mars' is not a WAN region" in capsys.readouterr().err


def test_step_time_is_measured_when_not_given(tmp_path, monkeypatch):
    from wan_diloco import api

    seen = []
    monkeypatch.setattr(api, "measure_step_time", lambda spec: seen.append(spec) or 0.1)
    rc, data = _plan(tmp_path)
    assert rc == 0 and len(seen) == 1 and seen[0].model.d_model == 128
    assert data["inputs"]["step_time_from"].startswith("measured here") and data["step_time_s"] == 0.1


@pytest.mark.slow
def test_measure_step_time_times_real_steps():
    from wan_diloco import spec
    from wan_diloco.api import measure_step_time

    micro = spec.from_document({"model": {"preset": "micro", "d_model": 16, "n_layers": 1, "d_ff": 32, "seq_len": 8,
                                          "vocab_size": 64}, "run": {"batch_size": 2, "min_step_s": 0.02},
                                "learner": {"num_fragments": 1}})
    assert 0.02 <= measure_step_time(micro, steps=2) < 10  # min_step_s pacing is a floor


def test_plan_warns_when_the_run_needs_more_syncer_shards(tmp_path, capsys):
    # The tiny preset, 4 learners, 1 ms steps: the plan picks H = 500, so 4 x 853,120 x 4 B / 0.5 s = 27 MB/s.
    config = tmp_path / "run.toml"
    config.write_text(Path(LOCAL).read_text() + "\n[plan]\nshard_merge_gb_s = 0.005\n")
    out = tmp_path / "plan.json"
    main(["plan", "--config", str(config), "--json", str(out), "--step-time", "0.001"])
    data = json.loads(out.read_text())
    demand = 4 * TINY_PARAMS * 4 / (data["sync_every"] * 0.001) / 1e9
    assert data["syncer_shards_needed"] == -(-demand // 0.005) >= 2 and data["syncer_shards"] == 1
    assert f"syncer.shards >= {data['syncer_shards_needed']}, it has 1" in data["shard_warning"]
    printed = capsys.readouterr().out
    assert "warning:" in printed and "0.005 GB/s: plan.shard_merge_gb_s" in printed
    assert (data["inputs"]["shard_merge_gb_s"], data["inputs"]["shard_merge_from"]) == (0.005, "plan.shard_merge_gb_s")
    rc, data = _plan(tmp_path, "--step-time", "0.1")  # 0.1 s steps: one shard of the measured rate keeps up
    assert data["syncer_shards_needed"] == 1 and data["shard_warning"] is None
    # Unset in the file: this checkout's bench/results/syncer.json (the test runs from the repository).
    measured = json.loads((ROOT / "bench" / "results" / "syncer.json").read_text())["planner"]
    assert data["inputs"]["shard_merge_from"].startswith("measured by bench/syncer.py at M = 4")
    assert data["inputs"]["shard_merge_gb_s"] == measured["merged_fp32_gb_s_one_shard_by_learners"]["4"]
