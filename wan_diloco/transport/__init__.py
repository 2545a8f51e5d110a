"""Fragment streaming over HTTP/2 (grpc.aio): message schema, client, server, status page.

The syncer plugs a ``Handler`` into ``TransportServer``; learners talk to it with
``SyncerClient``. Messages are our own versioned binary schema (``messages``),
large ones chunked (``framing``); downstream fan-out keeps the newest update per
fragment per learner (``fanout``). ``StatusServer`` serves /healthz, /status and
/metrics over aiohttp.
"""
from .client import Backoff, SyncerClient, TransportError
from .config import TlsConfig, TransportConfig, tune_for_link
from .fanout import LatestMailbox, UpdateHub
from .framing import BufferPool, MessageReader, Prepared, encode_chunks
from .loop import new_event_loop, run
from .messages import (
    WIRE_VERSION, Ack, BulkChunk, BulkRequest, FragmentUpload, GlobalUpdate, Kind, Message,
    MessageError, Metadata, OversizedError, Subscribe, decode_message, encode_message,
)
from .metrics import TransportMetrics
from .server import BulkSource, Handler, Rejected, TransportServer
from .status import StatusServer

__all__ = [
    "Ack", "Backoff", "BufferPool", "BulkChunk", "BulkRequest", "BulkSource", "FragmentUpload", "GlobalUpdate",
    "Handler", "Kind", "LatestMailbox", "Message", "MessageError", "Metadata", "OversizedError",
    "MessageReader", "Prepared", "Rejected", "StatusServer", "Subscribe", "SyncerClient", "TlsConfig",
    "TransportConfig", "TransportError", "TransportMetrics", "TransportServer", "UpdateHub",
    "WIRE_VERSION", "decode_message", "encode_chunks", "encode_message", "new_event_loop", "run",
    "tune_for_link",
]
