"""Per-sender credentials (#13): with ``per_sender_tokens`` a learner's own token (``derive_token``) lets
it speak only as itself; the run's token and another learner's token do not."""
import grpc
import pytest

from wan_diloco.transport import BulkRequest, Frame, TransportError, derive_token, encode_message
from wan_diloco.transport.security import bearer_metadata
from wan_diloco.transport.server import sender_metadata

from .conftest import TOKEN, arun, client_for, syncer


def frame(sender):
    return Frame(sender, 0, {"step": 1}, b"")


def test_derived_tokens_differ_per_sender_and_are_stable():
    assert derive_token(TOKEN, "learner-0") == derive_token(TOKEN, "learner-0")
    assert derive_token(TOKEN, "learner-0") != derive_token(TOKEN, "learner-1")
    assert derive_token(TOKEN, "learner-0") != derive_token(TOKEN + "x", "learner-0")


def test_a_learner_speaks_only_as_itself():
    async def main():
        async with syncer(per_sender_tokens=True) as (server, handler):
            async with client_for(server, token=derive_token(TOKEN, "learner-1")) as client:
                await client.send_metadata(frame("learner-1"))
                await client.upload_fragment(Frame("learner-1", 0, {}, b"x" * 1000))
                with pytest.raises(TransportError) as err:  # its token, someone else's name
                    await client.send_metadata(frame("learner-0"))
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "learner-0" in err.value.details
                with pytest.raises(TransportError) as err:
                    await client.upload_fragment(Frame("learner-0", 0, {}, b"x" * 1000))
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                # The run's own token on the wire is not a learner's (a client holding it sends what it
                # derives for the sender instead: below).
                call = client._channel(0).unary_unary("/wan_diloco.Syncer/Metadata")
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await call(encode_message(frame("learner-1")), timeout=5,
                               metadata=bearer_metadata(TOKEN) + (sender_metadata("learner-1"),))
                assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with client_for(server, token=TOKEN) as client:  # the run's token holder may be anyone
                await client.send_metadata(frame("learner-2"))
            return handler

    handler = arun(main())
    assert [f.sender for f in handler.metadata] == ["learner-1", "learner-2"]
    assert [f.sender for f, _ in handler.fragments] == ["learner-1"]


def test_a_message_naming_another_sender_than_its_call_is_refused():
    async def main():
        async with syncer(per_sender_tokens=True) as (server, handler):
            async with client_for(server, token=derive_token(TOKEN, "learner-1")) as client:
                # A bulk request whose header names learner-1 but whose body says learner-0.
                call = client._channel(0).unary_stream("/wan_diloco.Syncer/Bulk")
                data = encode_message(BulkRequest("learner-0", "fragment/0", {}))
                meta = bearer_metadata(derive_token(TOKEN, "learner-1")) + (sender_metadata("learner-1"),)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call(data, metadata=meta, timeout=5):
                        pass
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    arun(main())


def test_without_per_sender_tokens_the_run_token_works_for_everyone():
    async def main():
        async with syncer(per_sender_tokens=False) as (server, handler):
            async with client_for(server) as client:
                await client.send_metadata(frame("learner-0"))
                await client.send_metadata(frame("learner-3"))
            return handler

    assert len(arun(main()).metadata) == 2
