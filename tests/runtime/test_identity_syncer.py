"""The real syncer under launch's defaults (#23, cases 5 and 6): each learner holds only its own token, so
learner 0's host can neither subscribe as learner 1 nor open uploads under invented names; the real
learner 1 subscribes, and every refusal is on /metrics."""
import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wan_diloco import spec as rt
from wan_diloco.runtime.launch import Cluster
from wan_diloco.spec import TOKEN_ENV
from wan_diloco.transport import Frame, SyncerClient, TransportError, derive_token, run

from .conftest import TOKEN, micro_config


def identity_refusals(cluster) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.status_port}/metrics",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    family = families.get("wan_diloco_identity_refused")
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")} if family else {}


def test_a_learner_host_cannot_be_another_learner_or_invent_senders(tmp_path):
    path = micro_config(tmp_path, learners=2)  # says nothing about credentials: the defaults
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        own = {m: cluster._env_of(f"learner-{m}")[TOKEN_ENV] for m in (0, 1)}
        assert own == {m: derive_token(TOKEN, f"learner-{m}") for m in (0, 1)}  # never the run's token
        cluster.start_syncer()

        async def main():
            async with SyncerClient(cluster.syncer_target, own[0], cfg.transport) as host0:
                with pytest.raises(TransportError) as err:  # case 6: subscribing as learner 1 while it is down
                    async for _ in host0.subscribe("learner-1", "region-b"):
                        pass
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                for i in range(16):  # case 5: uploads under invented names
                    with pytest.raises(TransportError) as err:
                        await host0.upload_fragment(Frame(f"ghost-{i}", 0, {"base_version": 0}, bytes(100_000)))
                    # The server refuses before reading; a client still sending its stream may then see
                    # gRPC's "Internal error from Core" instead of the status (a race in the C core). What
                    # the server did is counted on /metrics below.
                    assert err.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
            async with SyncerClient(cluster.syncer_target, own[1], cfg.transport) as learner1:
                updates = learner1.subscribe("learner-1", "region-b")
                first = await asyncio.wait_for(updates.__anext__(), 30)  # the syncer's identity: it is in
                assert first.sender == "syncer"
                await updates.aclose()

        run(asyncio.wait_for(main(), 120))
        assert identity_refusals(cluster) == {"token": 17.0, "no_sender": 0.0, "certificate": 0.0, "message": 0.0}
