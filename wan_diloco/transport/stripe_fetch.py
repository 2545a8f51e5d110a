"""A large update to a learner, striped over its connections (the Fetch RPC): the other direction of ``stripes.py``.

The server can only answer calls, so the learner pulls: where a Subscribe stream
would send a Frame of at least twice ``stripe_min_bytes``, it sends a
``StripeOffer`` (the update's upload id and size) and waits. The learner fetches
the stripes, one Fetch call per connection; each answers with the same stripe
header Frame and raw bytes as a Stripe call, and the learner puts them together
with the very receiver the server uses for striped uploads (``StripeAssembler``:
same buffer, checks and refusals). Once every stripe was sent the Subscribe
stream goes on with the next update, so one update at a time is in flight per
subscriber, as with chunks. The fan-out cuts an update once per stripe count
(``Prepared.stripes``) for every subscriber that fetches it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import AsyncIterator

import grpc

from .framing import BufferPool, Prepared
from .handler import Rejected
from .messages import Frame, MessageError, StripeOffer, decode_message, encode_message
from .stripes import MAX_STRIPES, UPLOAD_ID, Stripe, StripeAssembler, StripeTimeout, stripe_count

FETCH_FIELDS = ("upload", "index", "count")


def parse_fetch(meta: object) -> tuple[str, int, int]:
    """(upload, index, count) of a Fetch request's ``meta.fetch``; MessageError naming the field that is wrong."""
    f = meta.get("fetch") if isinstance(meta, dict) else None
    if not isinstance(f, dict) or set(f) != set(FETCH_FIELDS):
        raise MessageError(f"fetch request: meta.fetch must be an object with exactly {', '.join(FETCH_FIELDS)}")
    if not isinstance(f["upload"], str) or not UPLOAD_ID.fullmatch(f["upload"]):
        raise MessageError("fetch request: upload must be 1-64 characters of [0-9A-Za-z_-]")
    for k in FETCH_FIELDS[1:]:
        if isinstance(f[k], bool) or not isinstance(f[k], int):
            raise MessageError(f"fetch request: {k} must be an integer, got {f[k]!r:.40}")
    if not 0 <= f["index"] < f["count"] <= MAX_STRIPES:
        raise MessageError(f"fetch request: need 0 <= index < count <= {MAX_STRIPES}, "
                           f"got index {f['index']} of {f['count']}")
    return f["upload"], f["index"], f["count"]


class Offer:
    """One update offered striped to one subscriber: the stripe count its first fetch chose, the stripes
    sent, and when the last byte went out."""

    def __init__(self, item: Prepared, upload: str) -> None:
        loop = asyncio.get_running_loop()
        self.item, self.upload, self.count = item, upload, 0
        self.sent: set[int] = set()
        self.claimed: set[int] = set()
        self.finished = loop.create_future()  # None once every stripe was sent; the error if one failed
        self.progress_at = loop.time()

    def claim(self, index: int, count: int) -> None:
        if self.count and count != self.count:
            raise MessageError(f"fetch of update {self.upload}: asks for {count} stripes, its first fetch "
                               f"asked for {self.count}")
        if index in self.claimed:
            raise MessageError(f"stripe {index} of update {self.upload} fetched twice")
        self.count = count
        self.claimed.add(index)

    def fail(self, error: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(error if isinstance(error, Exception) else
                                        MessageError(f"a fetch of update {self.upload} was cancelled"))
            self.finished.exception()  # retrieved: the Subscribe stream may be gone already


class StripeOffers:
    """The server's updates offered striped, by (subscriber, upload id)."""

    def __init__(self, config, name: str, metrics) -> None:
        self.config, self.name, self.metrics = config, name, metrics
        self.offers: dict[tuple[str, str], Offer] = {}

    async def send(self, item: Prepared, who: str) -> AsyncIterator[bytes]:
        """What a Subscribe stream of ``who`` sends for ``item``: its chunks, or, when large, an offer;
        then it waits until every stripe was fetched (StripeTimeout when none came for
        ``stream_idle_timeout_s``; the update goes back to the subscriber's mailbox with the stream)."""
        least = self.config.stripe_min_bytes
        if not least or item.body_bytes < 2 * least:
            for chunk in item.chunks:
                yield chunk
            return
        offer = Offer(item, secrets.token_hex(8))
        self.offers[(who, offer.upload)] = offer
        try:
            yield encode_message(StripeOffer(self.name, item.message.fragment, offer.upload, item.body_bytes))
            loop, idle_s = asyncio.get_running_loop(), self.config.stream_idle_timeout_s
            while not offer.finished.done():
                left = offer.progress_at + idle_s - loop.time()
                if left <= 0:
                    raise StripeTimeout(f"update {offer.upload} (fragment {item.message.fragment}): stripes "
                                        f"{sorted(set(range(offer.count or 1)) - offer.sent)} not fetched within "
                                        f"{idle_s:g} s (stream_idle_timeout_s)")
                await asyncio.wait([offer.finished], timeout=left)
            offer.finished.result()
        finally:
            self.offers.pop((who, offer.upload), None)
            offer.fail(MessageError(f"update {offer.upload} is no longer offered"))

    async def serve(self, request: bytes, who: str) -> AsyncIterator[bytes]:
        """One Fetch call: the stripe header Frame, then the stripe's bytes. An update nobody offered to
        ``who`` is NOT_FOUND; a fetch that does not fit the offer's others fails the offer."""
        req = decode_message(request, max_bytes=self.config.grpc_message_bytes)
        if not isinstance(req, Frame):
            raise MessageError(f"fetch request: expected Frame, got {type(req).__name__}")
        upload, index, count = parse_fetch(req.meta)
        offer = self.offers.get((who, upload))
        if offer is None:
            raise Rejected(f"no update {upload} is offered to {who} (fetched already, timed out, or never "
                           "offered)", grpc.StatusCode.NOT_FOUND)
        loop = asyncio.get_running_loop()
        try:
            offer.claim(index, count)
            st, chunks = offer.item.stripes(count)[index]
            yield encode_message(Frame(self.name, offer.item.message.fragment,
                                       dataclasses.replace(st, upload=upload).to_meta()))
            for chunk in chunks:
                offer.progress_at = loop.time()
                self.metrics.sent("Fetch", len(chunk))
                yield chunk
        except BaseException as e:
            offer.fail(e)
            raise
        offer.sent.add(index)
        offer.progress_at = loop.time()
        if len(offer.sent) == offer.count and not offer.finished.done():
            offer.finished.set_result(None)


async def _nothing(_: object) -> bytes:
    return b""


def fetch_assembler(config, pool: BufferPool, metrics) -> StripeAssembler:
    """A client's receiver of striped updates: the server's receiver of striped uploads, with no slots to take
    (the client asked for what arrives); ``fetch_striped`` says where each message goes."""
    return StripeAssembler(config, pool, _nothing, lambda who: None, _nothing, lambda bound, sender: None,
                           metrics, rpc="Fetch")


async def fetch_striped(assembler: StripeAssembler, channels: list, first: int, method: str, offer: StripeOffer,
                        sender: str, metadata: tuple) -> Frame:
    """The Frame ``offer`` announces, fetched as one Fetch call per connection (stripe i on channel
    ``first + i``) into ``assembler``'s buffers. MessageError for a corrupt or mismatched stripe; the
    grpc error of a failed call (the others are cancelled)."""
    config = assembler.config
    if offer.total > config.max_message_bytes:
        raise MessageError(f"oversized message: {offer.total} bytes offered, limit {config.max_message_bytes}")
    count = max(1, stripe_count(len(channels), offer.total, config.stripe_min_bytes))
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    assembler.deliver = _deliver_to(got)

    def expect(index: int):
        def check(st: Stripe) -> None:
            if (st.upload, st.index, st.count, st.total) != (offer.upload, index, count, offer.total):
                raise MessageError(f"fetched stripe {index} of update {offer.upload}: the server sent stripe "
                                   f"{st.index} of {st.count} of upload {st.upload} ({st.total} bytes), asked for "
                                   f"{index} of {count} ({offer.total} bytes)")
        return check

    calls = [channels[(first + i) % len(channels)].unary_stream(method)(
        encode_message(Frame(sender, offer.fragment, {"fetch": {"upload": offer.upload, "index": i, "count": count}})),
        timeout=config.upload_deadline_s(offer.total), metadata=metadata, wait_for_ready=True) for i in range(count)]
    try:
        await asyncio.gather(*(assembler.receive(call, None, offer.sender, expect(i)) for i, call in enumerate(calls)))
    finally:
        for call in calls:
            call.cancel()
    return got.result()


def _deliver_to(got: asyncio.Future):
    async def deliver(msg: Frame) -> bytes:
        if not got.done():
            got.set_result(msg)
        return b""
    return deliver
