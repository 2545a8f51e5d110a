"""Zstd chunks (format 2): where a payload's raw bytes are cut, and reading them a chunk at a time.

A payload's raw bytes are cut into chunks that zstd compresses independently, so a receiver
decompresses and unpacks one chunk at a time into its destination (never holding the whole
decompressed payload) and the chunks of one payload run on every worker thread.

Each chunk holds ``ZCHUNK_BYTES`` of values or codes (the last one less): 1 MiB, i.e. 2^18 fp32
values (``merge.CHUNK``), 2^19 bf16, 2^20 int8 or 2^21 4-bit codes. zstd level 1 measured the same
ratio on NF4 codes cut at 1, 2 or 4 MiB as in one frame (0.9008 of the raw bytes each): its window
is smaller than a chunk, so cutting costs nothing. 1 MiB keeps a decompressed chunk in a core's
cache while it is unpacked, and a 116 MB fp32 fragment in NF4 gives 14 chunks to share out.

For 8/4 bits a chunk is whole blocks and carries their scales: the high bytes of its blocks' scales,
then the low bytes, then their codes (format 1 had one pair of scale planes for the whole payload), so
every chunk unpacks on its own.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from wan_diloco.compression.config import Format
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks
from wan_diloco.merge import CHUNK

ZCHUNK_BYTES = 1 << 20


def chunk_blocks(fmt: Format) -> int:
    """Blocks per chunk (8/4 bits): ``ZCHUNK_BYTES`` of codes."""
    return ZCHUNK_BYTES // code_bytes_per_block(fmt.bits, fmt.block_size)


def spans(fmt: Format, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(raw offset, raw length) of every chunk of a fragment of tensors of ``sizes`` values in ``fmt``."""
    if fmt.quantized:
        per_block = 2 + code_bytes_per_block(fmt.bits, fmt.block_size)
        nb, m = sum(n_blocks(n, fmt.block_size) for n in sizes), chunk_blocks(fmt)
        return [(a * per_block, (min(a + m, nb) - a) * per_block) for a in range(0, nb, m)]
    total = sum(sizes) * fmt.bits // 8
    return [(o, min(ZCHUNK_BYTES, total - o)) for o in range(0, total, ZCHUNK_BYTES)]


def block_items(sizes: Sequence[int], fmt: Format) -> list[tuple[int, int, int, int]]:
    """(tensor, first block, end block, chunk) work items over the blocks of tensors of ``sizes``: pieces
    of at most ``CHUNK`` values from each tensor's start, also cut where a zstd chunk ends. Encoder and
    decoder sum Σx² over these same items, so their sums are the same bits."""
    bs, m = fmt.block_size, chunk_blocks(fmt)
    step, items, first = max(1, CHUNK // bs), [], 0
    for t, n in enumerate(sizes):
        k = n_blocks(n, bs)
        for a in range(0, k, step):
            b = min(a + step, k)
            while a < b:
                c = (first + a) // m
                end = min(b, (c + 1) * m - first)
                items.append((t, a, end, c))
                a = end
        first += k
    return items


_local = threading.local()


def scratch(n: int) -> np.ndarray:
    """This thread's chunk-sized scratch (uint8, grown on demand): one per worker, reused. A chunk of any
    format fits 5/4 of ``ZCHUNK_BYTES``: its scales add 2 bytes per block of at least 8 code bytes."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(max(n, ZCHUNK_BYTES * 5 // 4), np.uint8)
    return buf[:n]


class Packed:
    """A fragment's raw bytes as the packer's parts, read a chunk at a time (``read``) with no whole copy.

    ``parts``: byte-like arrays, back to back the raw bytes (32/16 bits), or for 8/4 bits each tensor's
    codes, with ``scale_bits`` the stored 16-bit pattern of every block's scale."""

    def __init__(self, fmt: Format, sizes: Sequence[int], parts: Sequence[np.ndarray],
                 scale_bits: np.ndarray | None = None):
        self.fmt, self.spans = fmt, spans(fmt, sizes)
        self.raw_len = sum(ln for _, ln in self.spans)
        self._parts = [np.frombuffer(memoryview(p).cast("B"), np.uint8) for p in parts]
        self._starts = np.cumsum([0] + [p.size for p in self._parts])
        self._scale_bits = scale_bits

    def _bytes(self, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
        """Bytes [lo, hi) of the parts joined: a view when one part holds them, else copied into ``out``."""
        i = int(np.searchsorted(self._starts, lo, "right")) - 1
        if hi <= self._starts[i + 1]:
            return self._parts[i][lo - self._starts[i]:hi - self._starts[i]]
        pos = 0
        while lo < hi:
            take = min(hi, int(self._starts[i + 1])) - lo
            out[pos:pos + take] = self._parts[i][lo - self._starts[i]:lo - self._starts[i] + take]
            pos, lo, i = pos + take, lo + take, i + 1
        return out[:pos]

    def read(self, c: int, out: np.ndarray) -> np.ndarray:
        """The raw bytes of chunk ``c``: a view of the parts, or written into ``out`` (its length)."""
        off, ln = self.spans[c]
        if not self.fmt.quantized:
            return self._bytes(off, off + ln, out)
        cb = code_bytes_per_block(self.fmt.bits, self.fmt.block_size)
        a = off // (2 + cb)
        m = ln // (2 + cb)
        sb = self._scale_bits[a:a + m]
        np.right_shift(sb, 8, out=out[:m], casting="unsafe")
        np.bitwise_and(sb, 0xFF, out=out[m:2 * m], casting="unsafe")
        codes = self._bytes(a * cb, (a + m) * cb, out[2 * m:])
        if codes.ctypes.data != out[2 * m:].ctypes.data:  # a view of one tensor's codes
            out[2 * m:] = codes
        return out


def copy_raw(read, chunk_spans: Sequence[tuple[int, int]], dst: np.ndarray, workers) -> None:
    """Write every chunk's raw bytes (``read(c, out)``) into ``dst`` (uint8, the raw length), on ``workers``."""
    def run(c: int) -> None:
        off, ln = chunk_spans[c]
        out = dst[off:off + ln]
        got = read(c, out)
        if got.ctypes.data != out.ctypes.data:
            out[:] = got

    workers.map(run, range(len(chunk_spans)))
