"""Which failed calls the client tries again, and that the answer it finally reports is the syncer's."""
import dataclasses

import grpc
import pytest

from wan_diloco.transport import SyncerClient, TransportError
from wan_diloco.transport.retry import worth_retrying

from .conftest import SMALL, TOKEN, arun


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, details, again", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
    # grpcio's asyncio client losing the server's status to a write that failed after it (grpc/grpc#36066)
    (grpc.StatusCode.INTERNAL, "Internal error from Core", True),
    (grpc.StatusCode.INTERNAL, "handler failed: ValueError: boom", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "max_uploads_per_sender 1 reached", False),
    (grpc.StatusCode.UNAUTHENTICATED, "bad token", False),
])
def test_only_an_unreachable_syncer_or_a_lost_answer_is_tried_again(code, details, again):
    assert worth_retrying(rpc_error(code, details)) is again


def tries(config, errors):
    """Run ``SyncerClient._retry`` over attempts that raise ``errors`` in turn; (outcome, attempts made)."""
    made = []

    async def attempt():
        made.append(1)
        error = errors[min(len(made), len(errors)) - 1]
        if error is None:
            return "ack"
        raise error

    async def main():
        async with SyncerClient("127.0.0.1:1", TOKEN, config) as client:
            try:
                return await client._retry("Upload", attempt), len(made)
            except TransportError as e:
                return e, len(made)

    return arun(main())


def test_a_lost_answer_is_asked_again_and_the_syncers_own_refusal_is_reported():
    lost = rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    refused = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_uploads_per_sender 1 reached")
    error, made = tries(SMALL, [lost, refused])
    assert made == 2 and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_uploads_per_sender" in error.details
    assert tries(SMALL, [lost, lost, None]) == ("ack", 3)


def test_answers_lost_for_the_whole_budget_end_as_that_error_and_others_end_at_once():
    lost = rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    error, made = tries(dataclasses.replace(SMALL, retry_budget_s=0.3), [lost])
    assert error.code == grpc.StatusCode.INTERNAL and made > 2
    error, made = tries(SMALL, [rpc_error(grpc.StatusCode.INTERNAL, "handler failed: boom")])
    assert error.code == grpc.StatusCode.INTERNAL and made == 1
