"""TLS and mutual TLS on loopback with throwaway certificates."""
import dataclasses
import ssl

import aiohttp
import grpc
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.transport import Frame, StatusServer, TlsConfig, TransportError, TransportMetrics, TransportServer
from wan_diloco.transport.dev_certs import make_dev_certs

from .conftest import SMALL, TOKEN, arun, client_for, syncer

META = Frame("learner-0", 0, {"step": 1, "c_tokens": [10], "clock": {"learner-0": 1}})


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


def with_tls(tls):
    return dataclasses.replace(SMALL, tls=tls, call_timeout_s=1.0, retry_budget_s=1.0)


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_round_trip(certs, mutual):
    server_cfg = with_tls(certs["server_mutual" if mutual else "server"])
    client_cfg = with_tls(certs["client_mutual" if mutual else "client"])

    async def main():
        async with syncer(config=server_cfg) as (server, handler), client_for(server, config=client_cfg) as client:
            assert (await client.send_metadata(META)).global_step == 1
            assert handler.metadata == [META]
            with pytest.raises(TransportError, match="UNAUTHENTICATED"):  # TLS does not replace the token
                async with client_for(server, token="another-token-123", config=client_cfg) as other:
                    await other.send_metadata(META)
            assert len(handler.metadata) == 1
    arun(main())


@pytest.mark.parametrize("client_tls", ["no-client-cert", "untrusted-ca", "cleartext"])
def test_tls_refuses_unverified_peers(certs, tmp_path, client_tls):
    if client_tls == "no-client-cert":
        tls = certs["client"]
    elif client_tls == "untrusted-ca":
        tls = dataclasses.replace(certs["client_mutual"], ca_file=make_dev_certs(tmp_path)["client"].ca_file)
    else:
        tls = None

    async def main():
        async with syncer(config=with_tls(certs["server_mutual"])) as (server, handler):
            async with client_for(server, config=with_tls(tls)) as client:
                with pytest.raises(TransportError) as err:
                    await client.send_metadata(META)
                assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert handler.metadata == []
    arun(main())


def test_missing_certificate_files_are_named():
    with pytest.raises(ConfigError, match="tls.cert_file: file .*nope.pem not found"):
        arun(TransportServer(object(), TOKEN, with_tls(TlsConfig(cert_file="nope.pem", key_file="nope.key"))).start())


def test_status_page_over_https_with_the_grpc_certificate(certs):
    async def main():
        async with StatusServer(lambda: {"ok": True}, TransportMetrics(), token=TOKEN, tls=certs["server_mutual"]) as page:
            assert page.url.startswith("https://127.0.0.1:")
            trust = ssl.create_default_context(cafile=certs["client"].ca_file)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                # no client certificate needed over HTTP: the token is the credential
                async with http.get(page.url + "/status", ssl=trust) as r:
                    assert r.status == 200 and await r.json() == {"ok": True}
                with pytest.raises(aiohttp.ClientSSLError):  # a certificate we do not trust
                    await http.get(page.url + "/status", ssl=ssl.create_default_context())
                with pytest.raises(aiohttp.ClientError):  # cleartext to the TLS port
                    await http.get(page.url.replace("https", "http") + "/status")
    arun(main())


def test_status_tls_needs_a_certificate():
    with pytest.raises(ConfigError, match="^tls.cert_file: a TLS status server needs cert_file"):
        StatusServer(dict, TransportMetrics(), token=TOKEN, tls=TlsConfig(ca_file="ca.pem"))
    with pytest.raises(ConfigError, match="^tls.cert_file: file .*nope.pem not found"):
        StatusServer(dict, TransportMetrics(), token=TOKEN, tls=TlsConfig(cert_file="nope.pem", key_file="k"))
