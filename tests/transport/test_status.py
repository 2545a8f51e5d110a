import asyncio
import errno
import json
import logging
import socket
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wan_diloco.config import ConfigError
from wan_diloco.transport import Frame, ListenError, StatusServer, TransportMetrics

from .conftest import TOKEN, arun, client_for, syncer

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_status_server_serves_health_status_and_parseable_metrics():
    async def main():
        async with syncer() as (server, handler):
            async with client_for(server) as client:
                await client.send_metadata(Frame("learner-0", 0, {"step": 1, "clock": {"learner-0": 1}}))
            learners = server.metrics.gauge("learners", "Learners seen", ["region"])
            learners.labels("us").set(3)

            async def status():
                return {"learners": {"learner-0": {"region": "us"}}, "versions": [1, 2]}

            async with StatusServer(status, server.metrics, token=TOKEN) as page, \
                    aiohttp.ClientSession(headers=AUTH) as http:
                assert page.auth_headers == AUTH
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


def test_status_and_metrics_need_the_bearer_token_but_healthz_does_not():
    async def main():
        async with StatusServer(lambda: {"secret": "learners"}, TransportMetrics(), token=TOKEN) as page, \
                aiohttp.ClientSession() as http:
            for path in ("/status", "/metrics"):
                for headers in ({}, {"Authorization": "Bearer wrong-token-123"}, {"Authorization": TOKEN},
                                {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"}):
                    async with http.get(page.url + path, headers=headers) as r:
                        body = await r.text()
                        assert r.status == 401, (path, headers)
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        assert "\n" not in body.strip() and "bearer token" in json.loads(body)["error"]
                        assert "learners" not in body
                async with http.get(page.url + path, headers=AUTH) as r:
                    assert r.status == 200
            async with http.get(page.url + "/healthz") as r:  # probes hold no secret
                assert r.status == 200 and (await r.text()).strip() == "ok"
    arun(main())


def test_an_open_status_page_is_only_allowed_on_loopback():
    with pytest.raises(ConfigError, match="^token: a status server on '0.0.0.0' .*needs the run's bearer token"):
        StatusServer(dict, TransportMetrics(), host="0.0.0.0")
    with pytest.raises(ConfigError, match="^token:"):
        StatusServer(dict, TransportMetrics(), host="0.0.0.0", token="short")
    StatusServer(dict, TransportMetrics(), host="0.0.0.0", token=TOKEN)  # fine with the token


def test_status_port_out_of_range_or_busy_is_a_clear_error():
    with pytest.raises(ValueError, match=r"status port: port 99999 is outside the valid range 0\.\.65535"):
        StatusServer(dict, TransportMetrics(), port=99999, token=TOKEN)

    async def main():
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            page = StatusServer(dict, TransportMetrics(), port=port, token=TOKEN)
            with pytest.raises(ListenError) as err:
                await page.start()
            assert str(err.value) == f"cannot listen on 127.0.0.1:{port}: address already in use"
            assert err.value.errno == errno.EADDRINUSE
            await page.stop()  # nothing left to stop, no error
    arun(main())


GARBAGE = [
    b"GET /status HTTP/1.1\r\nHost x\r\n\r\n",  # header without a colon
    b"GET /status HTTP/7.7\r\n\r\n",  # unknown version
    b"GET /status HTTP/1.1\r\nContent-Length: many\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS to a cleartext port\r\n\r\n",
]


def test_malformed_requests_get_400_without_an_error_traceback_each(caplog):
    async def main():
        async with StatusServer(dict, TransportMetrics(), token=TOKEN) as page:
            for garbage in GARBAGE:
                reader, writer = await asyncio.open_connection("127.0.0.1", page.port)
                try:
                    writer.write(garbage)
                    await writer.drain()
                    assert (await asyncio.wait_for(reader.read(100), 5)).startswith(b"HTTP/1.0 400"), garbage
                finally:
                    writer.close()
            async with aiohttp.ClientSession() as http, http.get(page.url + "/healthz") as r:
                assert r.status == 200  # still serving
    with caplog.at_level(logging.DEBUG):
        arun(main())
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [(r.name, r.getMessage()) for r in errors]


@pytest.mark.parametrize("sent", [b"", b"GET /status HTTP/1.1\r\nHost: a\r\n", b"GET /sta"])
def test_idle_and_half_sent_requests_are_closed_after_the_idle_timeout(sent):
    async def main():
        async with StatusServer(dict, TransportMetrics(), token=TOKEN, idle_timeout_s=0.5) as page:
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", page.port)
            try:
                writer.write(sent)
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, no answer
                assert 0.45 < time.monotonic() - t0 < 3
            finally:
                writer.close()
    arun(main())


def test_a_kept_alive_connection_is_closed_once_idle():
    async def main():
        async with StatusServer(dict, TransportMetrics(), token=TOKEN, idle_timeout_s=0.5) as page:
            reader, writer = await asyncio.open_connection("127.0.0.1", page.port)
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"ok\n"), 5)
                assert head.startswith(b"HTTP/1.1 200")
                t0 = time.monotonic()
                assert await asyncio.wait_for(reader.read(), 5) == b""
                assert time.monotonic() - t0 < 3
            finally:
                writer.close()
    arun(main())


def test_a_nan_or_infinite_value_is_served_as_null_so_that_browsers_can_parse_status():
    # Python's json writes NaN and Infinity, which the dashboard's JSON.parse refuses: one such value
    # in any status callable's answer would blank the page.
    async def main():
        def status():
            return {"learners": {"0": {"loss": float("nan"), "step": 3}}, "grace_s": [float("inf"), 0.5]}

        async with StatusServer(status, TransportMetrics(), token=TOKEN) as page, \
                aiohttp.ClientSession(headers=AUTH) as http:
            async with http.get(page.url + "/status") as r:
                assert r.status == 200
                text = await r.text()
        return text

    text = arun(main())
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"learners": {"0": {"loss": None, "step": 3}}, "grace_s": [None, 0.5]}
