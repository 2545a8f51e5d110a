"""Who a call is, decided before a byte of it is read: bearer tokens, certificate names, call rates.

Who calls is who its credential says: with per-sender tokens the token must be
the declared sender's own, with mutual TLS (``identity_from_cert``) the declared
sender must be the client certificate's name; anything else is refused before a
byte is read and counted (``identity_refused_total{reason}``). Each sender also
gets a token bucket of calls, so one token holder cannot keep the event loop
busy with small calls.
"""
from __future__ import annotations

import time
from urllib.parse import quote, unquote

import grpc

from .handler import Rejected
from .messages import MAX_NAME_CHARS
from .metrics import TransportMetrics
from .security import certificate_name, derive_token, token_matches

MAX_PEER_LINKS = 4096
SENDER_HEADER = "x-wdl-sender"  # call metadata: who calls, before any byte is read (limits, per-sender tokens)
# Why a call's identity was refused (the label of identity_refused_total: a fixed set, never caller text).
IDENTITY_REASONS = ("no_sender", "token", "certificate", "message")


def sender_metadata(sender: str) -> tuple[str, str]:
    """Upload call metadata naming ``sender`` (quoted: metadata values are printable ASCII)."""
    return SENDER_HEADER, quote(sender[:MAX_NAME_CHARS], safe="")


async def abort_call(metrics: TransportMetrics, context: grpc.aio.ServicerContext, rpc: str,
                     code: grpc.StatusCode, detail: str):
    """Count the error and end the call with ``code`` (``context.abort`` raises)."""
    metrics.error(rpc, code.name)
    await context.abort(code, f"{rpc}: {detail}")


def claimed_sender(context) -> str | None:
    """The sender a call names in its metadata (``SENDER_HEADER``), unchecked; None if it names none."""
    for key, value in context.invocation_metadata() or ():
        if key == SENDER_HEADER:
            return unquote(value if isinstance(value, str) else bytes(value).decode("ascii", "replace"))
    return None


def uploader(context) -> str:
    """Who a call counts against without an authenticated identity (one shared token): the sender it
    names, else the peer's host."""
    claimed = claimed_sender(context)
    if claimed is not None:
        return claimed
    peer = context.peer() or "unknown"
    # "ipv4:10.0.0.1:5555" -> "10.0.0.1": all connections of a host count together.
    _, _, address = peer.partition(":")
    return "peer " + (address.rpartition(":")[0] or address or peer)


class Callers:
    """The server's checks of who calls: ``auth`` (credentials), ``bind`` (a message is from its caller)
    and ``rate`` (calls a second per sender). ``token`` is the run's, already checked."""

    def __init__(self, token: str, per_sender_tokens: bool, cert_identity: bool, max_calls_per_s: float,
                 metrics: TransportMetrics) -> None:
        self.token, self.per_sender_tokens, self.cert_identity = token, per_sender_tokens, cert_identity
        self.max_calls_per_s, self.metrics = max_calls_per_s, metrics
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, at): per-sender call rate
        for reason in IDENTITY_REASONS:  # every series on /metrics from the start, at 0: alerts see a rise
            self.metrics.identity_refusals.labels(reason)

    async def _refuse(self, context, rpc: str, code: grpc.StatusCode, reason: str, detail: str):
        self.metrics.identity_refused(reason)
        await abort_call(self.metrics, context, rpc, code, detail)

    async def auth(self, context: grpc.aio.ServicerContext, rpc: str) -> str | None:
        """Check the call's credentials before anything is read; returns who it is (for ``bind`` and the
        per-sender limits): the named sender under per-sender tokens, the certificate's name under
        certificate identity, else None (one shared token: anyone may be anyone)."""
        metadata, claimed = context.invocation_metadata(), claimed_sender(context)
        own = claimed is not None and token_matches(metadata, derive_token(self.token, claimed))
        if self.per_sender_tokens:
            if claimed is None:
                await self._refuse(context, rpc, grpc.StatusCode.UNAUTHENTICATED, "no_sender",
                                   f"per-sender credentials: the call names no sender ({SENDER_HEADER})")
            if not own:
                await self._refuse(context, rpc, grpc.StatusCode.UNAUTHENTICATED, "token",
                                   f"missing or wrong bearer token for sender {claimed[:40]!r}")
        elif not (own or token_matches(metadata, self.token)):
            await abort_call(self.metrics, context, rpc, grpc.StatusCode.UNAUTHENTICATED,
                             "missing or wrong bearer token")
        if not self.cert_identity:
            return claimed if self.per_sender_tokens else None
        name = certificate_name(context.auth_context())
        if name is None:
            await self._refuse(context, rpc, grpc.StatusCode.UNAUTHENTICATED, "certificate",
                               "the client certificate names no one (one common name expected)")
        if claimed is not None and claimed != name:
            await self._refuse(context, rpc, grpc.StatusCode.PERMISSION_DENIED, "certificate",
                               f"the call says it is from {claimed[:40]!r}, its certificate is {name[:40]!r}'s")
        return name

    async def rate(self, context, rpc: str, who: str | None) -> None:
        """A token bucket per sender (``max_calls_per_s_per_sender``, bursts of twice that): one token
        holder cannot keep the event loop busy with small calls. ``who``: the authenticated identity."""
        rate = self.max_calls_per_s
        who, now = who or uploader(context), time.monotonic()
        tokens, at = self._buckets.get(who, (2 * rate, now))
        tokens = min(2 * rate, tokens + (now - at) * rate)
        if tokens < 1:
            self._buckets[who] = (tokens, now)
            await abort_call(self.metrics, context, rpc, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{who[:40]} calls more than {rate:g} times a second (max_calls_per_s_per_sender)")
        if who not in self._buckets and len(self._buckets) >= MAX_PEER_LINKS:
            self._buckets.pop(next(iter(self._buckets)))  # bounded: oldest first
        self._buckets[who] = (tokens - 1, now)

    def bind(self, who: str | None, sender: str) -> None:
        """A message must come from the sender the call's credentials are (per-sender token, certificate)."""
        if who is not None and sender != who:
            self.metrics.identity_refused("message")
            raise Rejected(f"the call's credentials are {who[:40]!r}'s, the message says it is from {sender[:40]!r}",
                           grpc.StatusCode.PERMISSION_DENIED)
