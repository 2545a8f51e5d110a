import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from wan_diloco.transport import Frame, StatusServer, TransportMetrics

from .conftest import arun, client_for, syncer


def test_status_server_serves_health_status_and_parseable_metrics():
    async def main():
        async with syncer() as (server, handler):
            async with client_for(server) as client:
                await client.send_metadata(Frame("learner-0", 0, {"step": 1, "clock": {"learner-0": 1}}))
            learners = server.metrics.gauge("learners", "Learners seen", ["region"])
            learners.labels("us").set(3)

            async def status():
                return {"learners": {"learner-0": {"region": "us"}}, "versions": [1, 2]}

            async with StatusServer(status, server.metrics) as page, aiohttp.ClientSession() as http:
                async with http.get(page.url + "/healthz") as r:
                    assert r.status == 200 and (await r.text()).strip() == "ok"
                async with http.get(page.url + "/status") as r:
                    assert r.status == 200 and await r.json() == await status()
                async with http.get(page.url + "/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    text = await r.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in families.values() for s in f.samples}
            assert samples[("wan_diloco_transport_messages_total", (("direction", "in"), ("rpc", "Metadata")))] == 1
            assert samples[("wan_diloco_transport_bytes_in_total", (("rpc", "Metadata"),))] > 0
            assert samples[("wan_diloco_learners", (("region", "us"),))] == 3
    arun(main())


def test_broken_status_callable_gives_500_not_a_dead_server():
    async def main():
        def status():
            raise RuntimeError("boom")
        async with StatusServer(status, TransportMetrics()) as page, aiohttp.ClientSession() as http:
            async with http.get(page.url + "/status") as r:
                assert r.status == 500 and "boom" in (await r.json())["error"]
            async with http.get(page.url + "/healthz") as r:
                assert r.status == 200
    arun(main())


def test_registries_are_private_per_server():
    a, b = TransportMetrics(), TransportMetrics()
    a.received("Upload", 100)
    a.gauge("quorum", "Quorum size").set(2)
    b.gauge("quorum", "Quorum size")  # same name in another registry: no clash
    assert b"wan_diloco_transport_bytes_in_total{rpc=\"Upload\"} 100.0" in a.render()
    assert b"Upload" not in b.render()
