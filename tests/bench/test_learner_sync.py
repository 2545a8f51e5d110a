"""The learner sync benchmark (#26) runs end to end on the micro preset and writes its rows."""
import json

import pytest

from bench import learner_sync


@pytest.mark.slow  # three learners compiled and stepped: 20-60 s on 2 shared cores
def test_bench_learner_sync_micro_row(tmp_path):
    out = tmp_path / "sync.json"
    learner_sync.main(["--preset", "micro", "--sync-every", "4", "--steps", "16", "--block-steps", "8",
                       "--warmup", "2", "--out", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    off, before, after = (row["variants"][k] for k in ("off", "on_training_thread", "on_worker"))
    assert row["steps_per_variant"] == 16 and off["uploads"] == 0
    assert before["uploads"] == after["uploads"] > 0 and before["payload_bytes"] == after["payload_bytes"]
    # The encode is timed on the training thread before, on the worker after, and nowhere when off.
    assert "training/delta_feedback_encode" in before["stages"] and "worker/delta_feedback_encode" in after["stages"]
    assert not any("encode" in k for k in off["stages"]) and not any(k.startswith("worker/") for k in before["stages"])
    assert after["worker_cpu_ms_per_step"] > 0 and before["worker_cpu_ms_per_step"] == 0
    for v in (before, after):
        assert v["ratio_median"] > 0 and v["ratio_cpu"] > 0 and v["ratio_from_stages"] >= 1
