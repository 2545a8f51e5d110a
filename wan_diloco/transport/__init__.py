"""Frame streaming over HTTP/2 (grpc.aio): message schema, client, server, status page.

Bytes only: the transport imports neither the protocol core nor the codecs.
Application messages are generic ``Frame``s (sender, routing key ``fragment``,
caller-owned JSON ``meta``, opaque payload) in our own versioned binary schema
(``messages``), large ones chunked (``framing``). The syncer plugs a ``Handler``
into ``TransportServer``; learners talk to it with ``SyncerClient``. Downstream
fan-out keeps the newest frame per fragment per subscriber (``fanout``).
``StatusServer`` serves /healthz, /status and /metrics over aiohttp (the last two
behind the bearer token). A server that cannot bind its address raises ``ListenError``.
"""
from .client import Backoff, SyncerClient, TransportError
from .config import TlsConfig, TransportConfig, channels_for_link, host_socket_buffer_bytes, tune_for_link
from .fanout import LatestMailbox, UpdateHub
from .framing import BufferPool, MessageReader, Prepared, encode_chunks
from .loop import new_event_loop, run
from .messages import (
    MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, MESSAGE_MAGIC, WIRE_VERSION, Ack, BulkChunk, BulkRequest, Frame, Kind,
    Message, MessageError, OversizedError, Subscribe, decode_message, encode_message,
)
from .metrics import TransportMetrics
from .probe import LinkSample, ProbePolicy
from .security import ListenError, derive_token
from .server import BulkSource, Handler, Rejected, TransportServer
from .status import StatusServer

__all__ = [
    "Ack", "Backoff", "LinkSample", "ProbePolicy", "BufferPool", "BulkChunk", "BulkRequest", "BulkSource", "Frame", "Handler", "Kind",
    "LatestMailbox", "ListenError", "MAX_HEADER_BYTES", "MAX_MESSAGE_BYTES", "MESSAGE_MAGIC", "Message", "MessageError",
    "MessageReader", "OversizedError", "Prepared", "Rejected", "StatusServer", "Subscribe", "SyncerClient",
    "TlsConfig", "TransportConfig", "TransportError", "TransportMetrics", "TransportServer", "derive_token", "UpdateHub",
    "WIRE_VERSION", "decode_message", "encode_chunks", "encode_message", "new_event_loop", "run",
    "channels_for_link", "host_socket_buffer_bytes", "tune_for_link",
]
