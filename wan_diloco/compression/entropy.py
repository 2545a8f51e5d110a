"""Entropy stage: zstd over a payload's raw bytes, one independent frame per chunk (``chunks``).

A zstd payload is a chunk table, one little-endian u32 per chunk (its stored length), then the
chunks back to back. A chunk is stored as its zstd frame when that is smaller than its raw bytes,
else raw (stored length = raw length); a payload whose table and chunks are not smaller than its
raw bytes is stored raw whole, without a table (the header's zstd flag says which). So a stored
payload is never larger than its raw form, and raw lengths follow from the format: nothing but the
stored lengths travels.

Decoding reads a chunk at a time into a buffer the caller reuses (zstd's stream reader fills it in
place), after checking the frame is exactly the table's length and declares the chunk's raw length;
zstd releases the GIL, so chunks decompress on every worker thread.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import zstandard

from wan_diloco.compression.chunks import scratch
from wan_diloco.compression.errors import CodecError

TABLE_ENTRY_BYTES = 4
_local = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (a zstd context is not shared across threads)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def compress_chunks(read: Callable, spans: Sequence[tuple[int, int]], level: int, workers,
                    out: bytearray, start: int) -> int | None:
    """Write the table and chunks of a zstd payload into ``out`` from ``start`` and return where they end.
    ``read(c, scratch)``: chunk c's raw bytes (it may be ``out``'s bytes where the raw bytes go, below).
    Chunk c is first written where its raw bytes go, ``start`` + table + its raw offset (room for it
    whatever the others' sizes), then moved down. None when the chunks are not smaller than the raw
    bytes: ``out`` then holds the raw bytes from ``start`` + table."""
    n = len(spans)
    raw_len = sum(ln for _, ln in spans)
    body = start + TABLE_ENTRY_BYTES * n
    with memoryview(out) as mv:
        def run(c: int) -> int:
            off, ln = spans[c]
            raw = read(c, scratch(ln))
            z = _cctx(level).compress(raw)
            keep = z if len(z) < ln else raw
            mv[body + off:body + off + len(keep)] = memoryview(keep).cast("B")
            return len(keep)

        lengths = workers.map(run, list(range(n)))
        if TABLE_ENTRY_BYTES * n + sum(lengths) >= raw_len:
            for (off, ln), stored in zip(spans, lengths):  # rare (noise): the raw bytes back in place
                if stored < ln:
                    mv[body + off:body + off + ln] = _dctx().decompress(mv[body + off:body + off + stored])
            return None
        pos = body
        for (off, _), ln in zip(spans, lengths):
            if body + off != pos:
                mv[pos:pos + ln] = mv[body + off:body + off + ln]  # memmove: never ahead of its source
            pos += ln
        mv[start:body] = np.asarray(lengths, "<u4").tobytes()
    return pos


class Chunks:
    """The raw bytes of a zstd payload's chunks, read one at a time; the table is checked on creation."""

    def __init__(self, body: memoryview, spans: Sequence[tuple[int, int]]):
        n = len(spans)
        table = TABLE_ENTRY_BYTES * n
        if len(body) < table:
            raise CodecError(f"zstd chunk table truncated: {len(body)} bytes, {n} chunks need {table}")
        lengths = np.frombuffer(body, "<u4", n).astype(np.int64)
        raw = np.fromiter((ln for _, ln in spans), np.int64, n)
        bad = np.flatnonzero((lengths == 0) | (lengths > raw))
        if bad.size:
            c = int(bad[0])
            raise CodecError(f"zstd chunk {c}: stored length {lengths[c]}, not in [1, its raw {raw[c]} bytes]")
        if table + int(lengths.sum()) != len(body):
            raise CodecError(f"zstd chunk table: {table} + {int(lengths.sum())} chunk bytes, but the payload has "
                             f"{len(body)} (truncated or extra bytes)")
        self.spans, self._body, self._lengths = spans, body, lengths
        self._starts = table + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    def read(self, c: int, out: np.ndarray) -> memoryview:
        """Chunk ``c``'s raw bytes: a view of the payload if stored raw, else decompressed into ``out``
        (writable, its raw length). CodecError if the frame is not exactly one frame of that length."""
        ln, raw_len = int(self._lengths[c]), self.spans[c][1]
        src = self._body[int(self._starts[c]):int(self._starts[c]) + ln]
        if ln == raw_len:
            return src
        try:
            size = zstandard.frame_content_size(src)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd chunk {c}: frame header is invalid: {e}") from None
        if size != raw_len:
            raise CodecError(f"zstd chunk {c}: frame declares {size} bytes, the chunk has {raw_len}")
        used = _frame_bytes(src, c)
        if used != ln:
            raise CodecError(f"zstd chunk {c}: {ln} bytes stored, its frame is {used}")
        try:
            reader = _dctx().stream_reader(src, read_size=ln)
            got = reader.readinto(out)
            while got < raw_len:  # readinto may stop early; zstd checks the content size at the end
                more = reader.readinto(memoryview(out)[got:])
                if not more:
                    break
                got += more
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd chunk {c} is corrupt: {e}") from None
        if got != raw_len:
            raise CodecError(f"zstd chunk {c} decoded to {got} bytes, not {raw_len}")
        return memoryview(out)


def _frame_bytes(src: memoryview, c: int) -> int:
    """Length of the zstd frame at the start of ``src`` from its block headers (zstd's
    ZSTD_findFrameCompressedSize), so that bytes after it are refused, not ignored."""
    try:
        pos = zstandard.frame_header_size(src)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd chunk {c}: frame header is invalid: {e}") from None
    checksum = 4 if src[4] & 0x04 else 0
    while True:
        if pos + 3 > len(src):
            raise CodecError(f"zstd chunk {c} is truncated")
        h = src[pos] | src[pos + 1] << 8 | src[pos + 2] << 16
        kind, size = (h >> 1) & 3, h >> 3
        if kind == 3:
            raise CodecError(f"zstd chunk {c} is corrupt: reserved block type")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if h & 1:
            return pos + checksum
