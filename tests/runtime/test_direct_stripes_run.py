"""A real run with direct stripes (transport.direct_port): the learners' striped uploads reach the syncer
over plain connections, not gRPC, and every copy still ends bit-identical."""
import json
from wan_diloco import spec as rt
from wan_diloco.runtime.launch import launch
from wan_diloco.runtime.launch_cluster import free_port

from .conftest import micro_config


def test_a_run_with_direct_stripes_ends_bit_identical_with_its_uploads_sent_direct(tmp_path):
    port = free_port()
    # One fragment of the micro model with a wider feed-forward (~230 KB) is at least twice stripe_min_bytes:
    # each upload is striped over 2 connections.
    path = micro_config(tmp_path, learners=2, steps=24, min_step_s=0.05, learner={"num_fragments": 1}, model={"d_ff": 256},
                        transport={"channels": 2, "stripe_min_bytes": 65536, "direct_port": port})
    code, summary = launch(rt.load(path), path.read_text(), str(tmp_path / "run"))
    assert code == 0, summary
    assert summary["bit_identical"]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(e for e in events if e["source"] == "syncer" and e["event"] == "final")
    assert sum(final["fragment_syncs"]) >= 2  # uploads merged during the run
    assert final["direct_bytes_in"] >= 2 * 131072, {k: final[k] for k in ("bytes_in", "fragment_syncs", "direct_bytes_in")}
