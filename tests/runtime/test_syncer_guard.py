"""The real syncer process: a wrong token changes nothing, malformed fragments get clear errors while it
keeps serving, /metrics is Prometheus text."""
import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import FragmentUpload, Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.launch import Cluster
from wan_diloco.transport import SyncerClient, TransportError, run

from .conftest import TOKEN, micro_config


def get(cluster, page):
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.status_port}/{page}",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def upload(fragment, payload, learner=0):
    msg = FragmentUpload(learner=learner, fragment=fragment, due_step=8, base_version=0, c_steps=8, c_tokens=1024,
                         clock=VectorClock({f"learner-{learner}": 3}), delta={}, nbytes=len(payload), payload=payload,
                         region="region-a")
    return serde.to_frame(msg)


def metadata(learner, step):
    return serde.to_frame(Metadata(learner=learner, step=step, c_steps=(step, step), c_tokens=(128 * step,) * 2,
                                   clock=VectorClock({f"learner-{learner}": step}), region="region-a"))


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    path = micro_config(tmp, learners=2)
    with Cluster(rt.load(path), path, tmp / "run") as cluster:
        cluster.start_syncer()
        cluster.layout = Assembly(rt.load(path)).layout
        yield cluster


def test_wrong_token_is_unauthenticated_and_changes_nothing(syncer):
    before = json.loads(get(syncer, "status"))

    async def main():
        async with SyncerClient(syncer.syncer_target, "not-the-token-42", rt.load(None).transport) as client:
            with pytest.raises(TransportError) as err:
                await client.send_metadata(metadata(0, 5))
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
    layout = syncer.layout
    zeros = {n: np.zeros(layout.shapes[n], np.float32) for n in layout.fragments[0]}
    raw = FragmentCodec(CodecConfig(bits=32, zstd=False), layout).encode(zeros)  # the run's codec: fp32
    nan = raw[:-4] + np.float32(np.nan).tobytes()  # a well-formed payload whose last value is NaN
    good = upload(0, raw)
    no_final = dataclasses.replace(good, meta={k: v for k, v in good.meta.items() if k != "final"})
    cases = [
        (upload(0, b"garbage"), "fragment 0"),
        (upload(0, raw + b"\0\0\0\0"), "fragment 0"),
        (upload(0, nan), "NaN"),
        (dataclasses.replace(good, fragment=5), "fragment 5"),
        (no_final, "final"),
        (dataclasses.replace(good, sender="learner-7"), "learner-7"),
    ]
    good_meta = metadata(1, 1)

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


def test_status_and_metrics_need_the_token_health_does_not(syncer):
    for page in ("status", "metrics"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{syncer.status_port}/{page}", timeout=5)
        assert err.value.code == 401
    with urllib.request.urlopen(f"http://127.0.0.1:{syncer.status_port}/healthz", timeout=5) as r:
        assert r.read().strip() == b"ok"


def test_hostile_token_holder_cannot_end_the_run_stall_it_or_crash_the_syncer(syncer):
    """A forged step past the budget, a clock of 25,000 entries and a finite but huge Δ (#13): each is
    refused with a clear error, the syncer keeps serving and its state stays as it was."""
    status = json.loads(get(syncer, "status"))
    layout = syncer.layout
    huge = {n: np.full(layout.shapes[n], 3.3e38, np.float32) for n in layout.fragments[0]}
    raw = FragmentCodec(CodecConfig(bits=32, zstd=False), layout).encode(huge)
    fat = metadata(1, 5)
    fat = dataclasses.replace(fat, meta={**fat.meta, "clock": {f"node-{i}": 1 for i in range(25_000)}})
    far = metadata(1, 10**9)
    far = dataclasses.replace(far, meta={**far.meta, "clock": {"learner-1": 1}})  # the step alone is wrong

    async def main():
        async with SyncerClient(syncer.syncer_target, TOKEN, rt.load(None).transport) as client:
            for call, text in ((client.send_metadata(far), "beyond the run's"),
                               (client.send_metadata(fat), "unknown node"),
                               (client.upload_fragment(upload(0, raw)), "quarantined")):
                with pytest.raises(TransportError) as err:
                    await call
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details, err.value
            assert (await client.send_metadata(metadata(1, 2))).sender == "syncer"  # still serving

    run(asyncio.wait_for(main(), 60))
    after = json.loads(get(syncer, "status"))
    assert after["global_step"] == max(2, status["global_step"]) and after["versions"] == status["versions"]
    assert after["quarantines"] == status["quarantines"] + 1
