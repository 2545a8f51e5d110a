"""Shared fixtures: an in-process syncer on an ephemeral loopback port, torn down always."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from wan_diloco.transport import (
    Ack, BulkSource, Rejected, SyncerClient, TransportConfig, TransportServer, UpdateHub, run,
)

TOKEN = "test-token-0123456789"


class RecordingHandler:
    """A minimal application: records what arrives, fans out through an UpdateHub."""

    def __init__(self, chunk_bytes: int = 64 * 1024) -> None:
        self.metadata: list = []
        self.fragments: list = []
        self.hub = UpdateHub(chunk_bytes)
        self.bulk_objects: dict[str, bytes] = {}
        self.reject_fragments = False

    async def on_metadata(self, frame):
        self.metadata.append(frame)
        return Ack(sender="syncer", global_step=len(self.metadata))

    async def on_fragment(self, msg):
        if self.reject_fragments:
            raise Rejected(f"fragment {msg.fragment}: stale base version {msg.meta['base_version']}")
        # keep a private copy: the payload view points into a transport buffer
        self.fragments.append((msg, bytes(msg.payload)))
        return Ack(sender="syncer", global_step=len(self.fragments), detail="merged")

    def subscribe(self, msg):
        return self.hub.stream(msg.sender)

    async def bulk(self, request):
        data = self.bulk_objects[request.name]
        pieces = [data[i : i + 100_000] for i in range(0, len(data), 100_000)]
        return BulkSource(len(data), pieces)


SMALL = TransportConfig(chunk_bytes=64 * 1024, max_message_bytes=4 << 20, channels=2,
                        call_timeout_s=10.0, retry_budget_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.2)


def arun(coro, timeout_s: float = 30.0):
    """Run a coroutine on a fresh (uv)loop with a hard timeout."""
    return run(asyncio.wait_for(coro, timeout_s))


@contextlib.asynccontextmanager
async def syncer(handler=None, config=SMALL, token=TOKEN, **kw):
    handler = handler or RecordingHandler(config.chunk_bytes)
    server = TransportServer(handler, token, config, "127.0.0.1:0", **kw)
    await server.start()
    try:
        yield server, handler
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def client_for(server, token=TOKEN, config=None):
    client = SyncerClient(server.target, token, config or server.config)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def handler():
    return RecordingHandler()
