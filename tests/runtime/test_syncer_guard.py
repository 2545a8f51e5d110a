"""The real syncer process: a wrong token changes nothing, malformed fragments get clear errors while it
keeps serving, /metrics is Prometheus text."""
import asyncio
import json
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wan_diloco.runtime import config as rt
from wan_diloco.runtime import wire
from wan_diloco.runtime.launch import Cluster
from wan_diloco.transport import FragmentUpload, Metadata, SyncerClient, TransportError, run

from .conftest import TOKEN, micro_config


def get(cluster, page):
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.status_port}/{page}", timeout=5) as r:
        return r.read().decode()


def upload(fragment, payload, sender="learner-0"):
    return FragmentUpload(sender, "region-a", fragment, 0, 8, 1024, {sender: 3}, payload)


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    path = micro_config(tmp, learners=2)
    with Cluster(rt.load(path), path, tmp / "run") as cluster:
        cluster.start_syncer()
        yield cluster


def test_wrong_token_is_unauthenticated_and_changes_nothing(syncer):
    before = json.loads(get(syncer, "status"))

    async def main():
        async with SyncerClient(syncer.syncer_target, "not-the-token-42", rt.load(None).transport) as client:
            with pytest.raises(TransportError) as err:
                await client.send_metadata(Metadata("learner-0", "region-a", 5, (5, 5), (640, 640), {"learner-0": 5}))
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(TransportError, match="UNAUTHENTICATED"):
                await client.upload_fragment(upload(0, b"x" * 100))

    run(asyncio.wait_for(main(), 30))
    after = json.loads(get(syncer, "status"))
    for key in ("versions", "global_step", "bytes_in", "rejected"):
        assert after[key] == before[key], key
    assert after["learners"]["0"]["last_seen_s_ago"] is None  # never counted as seen


def test_malformed_fragments_get_clear_errors_and_the_syncer_keeps_serving(syncer):
    status = json.loads(get(syncer, "status"))
    n0 = status["fragment_bytes"][0]
    good_meta = Metadata("learner-1", "region-b", 1, (1, 1), (128, 128), {"learner-1": 1})
    nan = np.full(n0 // 4, np.nan, np.float32).tobytes()
    cases = [
        (upload(0, b"garbage"), "envelope"),
        (upload(0, wire.seal({"due_step": 8, "final": False}, b"\0" * (n0 + 4))), f"payload of {n0 + 4} bytes, expected {n0}"),
        (upload(0, wire.seal({"due_step": 8, "final": False}, nan)), "NaN or Inf"),
        (upload(5, wire.seal({"due_step": 8, "final": False}, b"")), "fragment 5 out of range"),
        (upload(0, wire.seal({"due_step": 8}, b"")), "'final'"),
        (upload(0, wire.seal({"due_step": 8, "final": False}, b""), sender="learner-7"), "not a learner of this run"),
    ]

    async def main():
        async with SyncerClient(syncer.syncer_target, TOKEN, rt.load(None).transport) as client:
            for msg, text in cases:
                with pytest.raises(TransportError) as err:
                    await client.upload_fragment(msg)
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert text in err.value.details, (text, err.value.details)
                assert (await client.send_metadata(good_meta)).sender == "syncer"  # still serving

    run(asyncio.wait_for(main(), 60))
    after = json.loads(get(syncer, "status"))
    assert after["versions"] == status["versions"] and after["rejected"] == status["rejected"] + len(cases)
    assert after["learners"]["1"]["alive"] is True


def test_metrics_parse_as_prometheus_text(syncer):
    families = {f.name: f for f in text_string_to_metric_families(get(syncer, "metrics"))}
    assert "wan_diloco_fragment_version" in families and "wan_diloco_transport_bytes_in" in families
    versions = [s for s in families["wan_diloco_fragment_version"].samples]
    assert sorted(s.labels["fragment"] for s in versions) == ["0", "1"]
    assert get(syncer, "healthz").strip() == "ok"
