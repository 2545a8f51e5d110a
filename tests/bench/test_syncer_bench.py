"""The syncer benchmark (#15) runs end to end on a tiny layout and writes its schema, with consistent figures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.syncer import fragment_cycles, upload_round_trips

ROOT = Path(__file__).resolve().parents[2]
SPLIT = {"transport", "decode", "merge", "outer", "encode"}
ROW = {"shards", "learners", "fragments_per_s", "merged_gb_s", "merged_gb_s_per_core", "in_gbit_s", "out_gbit_s",
       "round_latency_ms", "upload_round_trip_ms", "fragment_cycle_ms", "cpu_split"}


@pytest.mark.slow  # syncer shards and learner processes: 40-70 s
def test_bench_syncer_tiny_run(tmp_path):
    out = tmp_path / "syncer.json"
    subprocess.run([sys.executable, "-m", "bench.syncer", "--layout", "tiny", "--fragments", "2", "--learners", "2",
                    "--shards", "1,2", "--reps", "1", "--rounds", "4", "--warmup-rounds", "2", "--max-seconds", "20",
                    "--out", str(out)], cwd=ROOT, check=True, timeout=400, capture_output=True)
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [(r["shards"], r["learners"]) for r in doc["rows"]] == [(1, 2), (2, 2)]
    row, two = doc["rows"]
    # Two shards, one fragment each: both measured, every round of each still merges both learners.
    assert len(two["window_s_per_shard"]) == 2 and all(g > 0 for g in two["merged_gb_s_per_shard"])
    assert two["merged_gb_s"] == pytest.approx(sum(two["merged_gb_s_per_shard"]))
    assert two["contributors_per_round"] == [2] and two["learner_upload_errors"] == 0
    assert ROW <= set(row) and set(row["cpu_split"]) == SPLIT
    for key in ROW - {"shards", "learners", "cpu_split"}:
        assert row[key] > 0, key
    assert all(v >= 0 for v in row["cpu_split"].values()) and row["cpu_split"]["merge"] > 0

    # Every round merges all M = 2 learners' fragments (K = M): fragments = rounds x M.
    assert row["uploads"] == 2 * row["rounds"] >= 2 and row["contributors_per_round"] == [2]
    assert row["learner_upload_errors"] == 0 and not row["syncer_transport_errors"]
    assert row["fragments_per_s"] == pytest.approx(2 * row["rounds_per_s"])
    # Merged bytes = fragments x their fp32 size: the mean merged size is one of the fragments' sizes.
    sizes = doc["layout"]["fragment_fp32_bytes"]
    mean_bytes = row["merged_gb_s"] * 1e9 / row["fragments_per_s"]
    assert min(sizes) * (1 - 1e-9) <= mean_bytes <= max(sizes) * (1 + 1e-9)
    # The split accounts for all the syncer's CPU: its sum is the inverse of GB merged per CPU second.
    assert sum(row["cpu_split"].values()) * row["merged_gb_s_per_core"] == pytest.approx(1.0, rel=1e-6)
    assert row["merged_gb_s"] / row["syncer_cpu_cores_busy"] == pytest.approx(row["merged_gb_s_per_core"])
    assert row["round_latency_ms"] > 0 and row["round_latency_to_publish_ms"] > 0

    assert {r["learners"] for r in doc["inprocess"]} == {2}
    # The hot path against memcpy in the same run, per thread count (1 and every core), and a round's memory.
    block = doc["per_stage_cpu_s_per_gb"]
    refs = block["references"]
    assert 0 < refs["np_copy"] < refs["codec_decode_1_thread"] and refs["zstd_decompress"] > 0
    top = max(doc["settings"]["inprocess_threads"])
    assert refs[f"codec_decode_wall_1_vs_{top}_threads"] > 0
    assert set(block["by_threads"]) == {str(t) for t in doc["settings"]["inprocess_threads"]} and "1" in block["by_threads"]
    one = block["by_threads"]["1"]["M=2"]
    assert one["merged_gb_per_cpu_s"] == pytest.approx(1 / one["total"])
    assert block["ratios"]["M=2: runtime decode + checks / codec decode (1 thread)"] == pytest.approx(
        one["decode"] / refs["codec_decode_1_thread"])
    assert 1 < doc["round_memory_fragments"]["M=2"]["fragments"] < 8
    mem = doc["round_memory_fragments"]["M=2"]
    assert mem["fragments"] == max(mem["while_deltas_arrive_fragments"], mem["closing_upload_fragments"])
    for r in doc["inprocess"]:
        assert all(r["stage_cpu_ms"][k] > 0 for k in ("decode", "merge", "outer", "encode"))
    ceiling = doc["ceiling"]["per_learners"][0]
    assert (ceiling["shards"], ceiling["learners"]) == (1, 2) and ceiling["wire_in_gbit_s"] > 0
    assert ceiling["per_learner_link_gbit_s"] == pytest.approx(ceiling["wire_in_gbit_s"] / 2)
    assert doc["planner"]["merged_fp32_gb_s_one_shard_by_learners"] == {"2": row["merged_gb_s"]}
    assert doc["planner"]["merged_fp32_gb_s_by_shards_and_learners"]["S=2,M=2"] == two["merged_gb_s"]


def test_an_upload_round_trip_ends_at_the_first_update_of_its_fragment_past_its_version():
    # learner log rows: sent [fragment, cycle, t_start, t_acked], recv [fragment, to_version, t]
    log = {"sent": [[0, 0, 1.0, 1.2], [0, 1, 2.0, 2.1], [1, 0, 0.5, 0.6], [1, 1, 2.2, 2.3]],
           "recv": [[1, 1, 0.9], [0, 1, 1.5], [0, 3, 3.0], [0, 2, 2.7], [0, 1, 2.05]]}
    # (1, 0) started before the window, (1, 1) never got its update: neither counts
    assert upload_round_trips([log], 0.8, 2.5) == pytest.approx([0.5, 0.7])
    # fragment 0's cycles 0 -> 1 (1.0 s); fragment 1's 0 -> 1 starts before the window
    assert fragment_cycles([log], 0.8, 2.5) == pytest.approx([1.0])
