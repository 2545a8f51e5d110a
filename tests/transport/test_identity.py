"""A sender is who its credential says (#23, cases 5 and 6): with the run file's defaults a learner's own
token (or its certificate's name) is its identity, calls declaring another sender are refused before a
byte is read and counted, and the per-sender limits hold per identity, not per declared name."""
import asyncio
import dataclasses
import logging

import grpc
import pytest

from wan_diloco import spec as rt
from wan_diloco.config import ConfigError
from wan_diloco.runtime.launch import Cluster
from wan_diloco.spec import TOKEN_ENV
from wan_diloco.transport import Frame, Subscribe, TlsConfig, TransportError, derive_token, encode_message
from wan_diloco.transport import server as server_module
from wan_diloco.transport.dev_certs import make_run_certs
from wan_diloco.transport.framing import encode_chunks
from wan_diloco.transport.security import bearer_metadata, call_token, require_bound_identity
from wan_diloco.transport.server import SERVICE, sender_metadata

from .conftest import SMALL, TOKEN, RecordingHandler, arun, client_for, syncer

DEFAULTS = rt.load(None).transport  # what a run file that says nothing about credentials gets


def as_syncer(**changes):
    """A transport config with the run file's credential defaults, the TransportServer built as
    `wan-diloco syncer` builds it (``per_sender_tokens = transport.per_learner_tokens``)."""
    config = dataclasses.replace(SMALL, per_learner_tokens=DEFAULTS.per_learner_tokens, tls=DEFAULTS.tls, **changes)
    return {"config": config, "per_sender_tokens": config.per_learner_tokens}


def handed_out(tmp_path, m: int) -> str:
    """The token `launch` gives learner ``m``'s process (its $WAN_DILOCO_TOKEN) for a run token TOKEN."""
    cluster = Cluster(rt.load(None), tmp_path / "run.toml", tmp_path / "run", token=TOKEN)
    return cluster._env_of(f"learner-{m}")[TOKEN_ENV]


def refusals(server, reason):
    return server.metrics.identity_refusals.labels(reason)._value.get()


class SlowUploads:
    """Upload calls on one raw connection with any token and declared sender: they send a first chunk
    (a large fragment's prelude), then nothing until released, as case 5's attacker did."""

    def __init__(self, server):
        self.server, self.release, self.calls = server, asyncio.Event(), []

    async def __aenter__(self):
        self.channel = grpc.aio.insecure_channel(self.server.target, options=self.server.config.client_options())
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await asyncio.gather(*self.calls, return_exceptions=True)
        await self.channel.close()

    def start(self, sender: str, token: str) -> asyncio.Future:
        first = next(encode_chunks(Frame(sender, 0, {}, bytes(300_000)), self.server.config.chunk_bytes))

        async def chunks():
            yield first
            await self.release.wait()

        call = self.channel.stream_unary(f"/{SERVICE}/Upload")(
            chunks(), timeout=20, metadata=bearer_metadata(token) + (sender_metadata(sender),))
        self.calls.append(asyncio.ensure_future(call))
        return self.calls[-1]


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_sixteen_invented_senders_take_no_upload_slot_and_a_learner_still_uploads(tmp_path):
    """Case 5: learner 0's host, with the token launch gave it, opens 16 slow uploads under invented names
    (and a large fragment's prelude). Each is refused
    (UNAUTHENTICATED) before a slot or a byte; under its own name it holds only its share; learner 1's
    upload goes through at once."""
    kw = as_syncer(max_concurrent_uploads=4, max_uploads_per_sender=2, stream_idle_timeout_s=10.0)

    async def main():
        async with syncer(**kw) as (server, handler):
            mine = handed_out(tmp_path, 0)  # the compromised host's credential
            assert mine == derive_token(TOKEN, "learner-0") != TOKEN
            async with SlowUploads(server) as slow:
                invented = [slow.start(f"ghost-{i}", mine) for i in range(16)]
                for call in invented:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await asyncio.wait_for(call, 5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert refusals(server, "token") == 16 and server._uploads_by == {} and server._slots_held == 0
                own = [slow.start("learner-0", mine) for _ in range(3)]  # its own name: its share only
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(own[2], 5)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert server._uploads_by == {"learner-0": 2}
                async with client_for(server, token=handed_out(tmp_path, 1)) as learner:
                    ack = await asyncio.wait_for(learner.upload_fragment(Frame("learner-1", 1, {}, b"x" * 1000)), 5)
                assert ack.detail == "merged" and [m.sender for m, _ in handler.fragments] == ["learner-1"]
    arun(main())


def test_every_upload_slot_held_is_reported_though_no_upload_waits(monkeypatch, caplog):
    """Case 5 had no "slots busy" line: learners' uploads waited on their own side, none at the syncer."""
    monkeypatch.setattr(server_module, "SLOTS_BUSY_WARN_S", 0.2)
    kw = as_syncer(max_concurrent_uploads=2, max_uploads_per_sender=1, stream_idle_timeout_s=10.0)
    told = []  # what the syncer makes a warning event of

    async def main():
        async with syncer(**kw) as (server, handler):
            server.on_warning = told.append
            async with SlowUploads(server) as slow:
                for m in (0, 1):
                    slow.start(f"learner-{m}", derive_token(TOKEN, f"learner-{m}"))
                await until(lambda: server._slots_held == 2)
                await asyncio.sleep(0.6)
                assert server.metrics.gauge("upload_slots_in_use", "")._value.get() == 2
            await until(lambda: server._slots_held == 0)
    with caplog.at_level(logging.WARNING, logger=server_module.__name__):
        arun(main())
    warnings = [r.getMessage() for r in caplog.records if "upload slots" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per episode
    assert "all 2 upload slots (transport.max_concurrent_uploads) have been busy" in warnings[0]
    assert "'learner-0' x1" in warnings[0] and "'learner-1' x1" in warnings[0]
    assert told == warnings


def test_a_subscribe_claiming_another_learner_is_refused_and_that_learner_gets_its_stream(tmp_path):
    """Case 6: learner 0's credential as launch hands it out (or a raw run token) subscribing as learner 1
    is refused, so the real learner 1 can subscribe and nobody else receives its updates."""
    async def main():
        async with syncer(**as_syncer()) as (server, handler):
            async with client_for(server, token=handed_out(tmp_path, 0)) as impostor:
                with pytest.raises(TransportError) as err:
                    async for _ in impostor.subscribe("learner-1", "us"):
                        pass
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                call = impostor._channel(0).unary_stream(f"/{SERVICE}/Subscribe")
                request = encode_message(Subscribe(sender="learner-1", region="us", instance="f" * 16))
                with pytest.raises(grpc.aio.AioRpcError) as raw:  # the run's token itself is never a learner's
                    async for _ in call(request, timeout=5,
                                        metadata=bearer_metadata(TOKEN) + (sender_metadata("learner-1"),)):
                        pass
                assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert handler.hub.subscribers == [] and refusals(server, "token") == 2
            async with client_for(server, token=handed_out(tmp_path, 1)) as learner:
                updates = learner.subscribe("learner-1", "us")
                first = asyncio.ensure_future(updates.__anext__())
                await until(lambda: handler.hub.subscribers == ["learner-1"])
                handler.hub.publish(Frame("syncer", 3, {"to_version": 1}, b"abc"))
                assert (await asyncio.wait_for(first, 5)).fragment == 3
                await updates.aclose()
    arun(main())


@pytest.fixture(scope="module")
def run_certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_run_certs(d, ("127.0.0.1",), learners=2, days=1)
    ca = str(d / "ca.pem")
    learner = lambda m: TlsConfig(cert_file=str(d / f"learner-{m}.pem"), key_file=str(d / f"learner-{m}.key"),  # noqa: E731
                                  ca_file=ca, mutual=True)
    return TlsConfig(cert_file=str(d / "syncer.pem"), key_file=str(d / "syncer.key"), ca_file=ca, mutual=True), learner


@pytest.mark.parametrize("per_sender_tokens", [True, False])
def test_with_mutual_tls_a_learner_is_its_certificate(run_certs, per_sender_tokens):
    """(d): learner 0's certificate declaring learner 1 is refused (PERMISSION_DENIED) and counted, whether
    its token is learner 1's own or the one shared token; as itself it is served."""
    server_tls, learner_tls = run_certs
    config = dataclasses.replace(SMALL, tls=server_tls, per_learner_tokens=per_sender_tokens)

    async def main():
        async with syncer(config=config, per_sender_tokens=per_sender_tokens) as (server, handler):
            client_cfg = dataclasses.replace(config, tls=learner_tls(0))
            async with client_for(server, token=TOKEN, config=client_cfg) as client:
                await client.send_metadata(Frame("learner-0", 0, {}))
                for call in (client.send_metadata(Frame("learner-1", 0, {})),
                             client.upload_fragment(Frame("learner-1", 0, {}, b"x" * 1000))):
                    with pytest.raises(TransportError) as err:
                        await call
                    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                    assert "'learner-1', its certificate is 'learner-0''s" in err.value.details
            assert refusals(server, "certificate") == 2 and server._uploads_by == {}
            return handler

    assert [f.sender for f in arun(main()).metadata] == ["learner-0"]


def test_identity_from_cert_off_leaves_names_to_the_token(run_certs):
    server_tls, learner_tls = run_certs
    config = dataclasses.replace(SMALL, tls=dataclasses.replace(server_tls, identity_from_cert=False))

    async def main():
        async with syncer(config=config, per_sender_tokens=True) as (server, handler):
            client_cfg = dataclasses.replace(config, tls=learner_tls(0))
            async with client_for(server, token=derive_token(TOKEN, "learner-1"), config=client_cfg) as client:
                await client.send_metadata(Frame("learner-1", 0, {}))
            return handler

    assert [f.sender for f in arun(main()).metadata] == ["learner-1"]


def test_a_client_sends_its_senders_own_token_never_the_runs():
    assert call_token(TOKEN, "learner-3") == derive_token(TOKEN, "learner-3")
    own = derive_token(TOKEN, "learner-3")
    assert call_token(own, "learner-3") == own and call_token(own, "learner-4") == own  # the server judges


def test_credential_bound_identity_is_the_default():
    assert DEFAULTS.per_learner_tokens and not DEFAULTS.allow_shared_token
    assert TlsConfig().identity_from_cert


@pytest.mark.parametrize("address, changes, refused", [
    ("192.0.2.10:7070", {"per_learner_tokens": False}, True),  # TEST-NET: need not exist, nothing binds
    ("[2001:db8::1]:7070", {"per_learner_tokens": False}, True),
    ("192.0.2.10:7070", {"per_learner_tokens": False, "allow_shared_token": True}, False),
    ("192.0.2.10:7070", {}, False),  # per-learner tokens (the default)
    ("127.0.0.1:7070", {"per_learner_tokens": False}, False),  # loopback: the by-hand local run
    ("localhost:0", {"per_learner_tokens": False}, False),
])
def test_a_shared_token_off_loopback_is_refused_unless_allowed(address, changes, refused):
    config = dataclasses.replace(DEFAULTS, **changes)
    if refused:
        with pytest.raises(ConfigError, match=r"^transport.allow_shared_token: .* any token holder could speak "
                                              r"for any learner"):
            require_bound_identity(address, config)
    else:
        require_bound_identity(address, config)


def test_per_learner_certificates_bind_identity_without_per_learner_tokens(run_certs):
    server_tls, _ = run_certs
    config = dataclasses.replace(DEFAULTS, per_learner_tokens=False, tls=server_tls)
    require_bound_identity("192.0.2.10:7070", config)
    with pytest.raises(ConfigError, match="allow_shared_token"):
        require_bound_identity("192.0.2.10:7070", dataclasses.replace(
            config, tls=dataclasses.replace(server_tls, identity_from_cert=False)))
