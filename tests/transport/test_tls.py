"""TLS and mutual TLS on loopback with throwaway certificates."""
import dataclasses

import grpc
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.transport import Frame, TlsConfig, TransportError, TransportServer
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
