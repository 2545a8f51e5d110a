"""An 8/4-bit upload kept as its codes: checked and measured on receipt, decoded straight into a merge.

A syncer folds each upload into a round's running sums (``merge.Accumulator``). Decoding it first writes a
fragment of float32 values that the fold then reads back: 8 bytes of memory traffic per value, and one more
fragment held, for values that are used once. ``scan`` instead reads a payload's chunks once into a buffer of
raw bytes (an eighth of the values' size in 4 bits), validates every scale and computes each tensor's Σx² as
the merge would from the values (``merge.sum_squares``'s items, each dequantized into this thread's
cache-sized scratch: the same bits, so RDA's norms need no pass over values); ``Coded.fold_into`` then dequantizes
each item into the sums in one pass (``kernels.fold4`` / ``fold8``: the same bits as decode then fold).
Anything that wants the values themselves reads them as from a ``Decoded``: the first lookup decodes the whole
fragment (``materialize``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

import numpy as np

from wan_diloco import kernels
from wan_diloco.buffers import BufferPool, thread_scratch
from wan_diloco.compression import blocks, chunks, pack
from wan_diloco.compression.config import INT4_QMAX, INT8_QMAX, Format
from wan_diloco.compression.errors import NonFiniteError
from wan_diloco.compression.quantize import code_bytes_per_block, n_blocks
from wan_diloco.merge import Workers, chunk_sum_squares, per_tensor
from wan_diloco.merge import chunks as merge_chunks

# Raw-byte buffers of uploads between receipt and fold: reused like the float32 fragments (fresh pages cost
# faults), in their own pool so a small buffer never takes a fragment-sized one.
RAW = BufferPool()


class _Stored:
    """The chunks ``scan`` kept, read back as a decode source (``pack.unpack``'s ``read`` and ``spans``)."""

    def __init__(self, raw: Sequence[np.ndarray], chunk_spans: Sequence[tuple[int, int]]):
        self.raw, self.spans = raw, chunk_spans

    def read(self, c: int, out=None) -> np.ndarray:
        return self.raw[c]


class Coded(Mapping):
    """A fragment's tensors as an upload's codes: ``fold_into`` a merge's sums, ``sum_squares`` (Σx² per
    tensor: ``merge.sum_squares`` of the values, to the bit: ``merge_sums``), ``shapes``; looking a tensor
    up decodes them all (``Decoded``'s values). ``handed_over`` and ``clear`` as ``Decoded``'s: ``clear``
    lets the raw bytes go."""

    handed_over: bool = False
    merge_sums = True  # ``sum_squares`` are the merge's own (``Decoded``'s are summed over the decoder's items)

    def __init__(self, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]], fmt: Format,
                 sizes: Sequence[int], source: _Stored, scales: list[np.ndarray], sum_squares: np.ndarray,
                 workers: Workers, geo: "_Geometry"):
        self._names, self.shapes, self.fmt, self.sizes = list(names), dict(shapes), fmt, list(sizes)
        self._geo = geo
        self._source, self._scales, self.sum_squares, self._workers = source, scales, sum_squares, workers
        self._values: dict[str, np.ndarray] | None = None

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.materialize()[name]

    def materialize(self) -> dict[str, np.ndarray]:
        """The decoded tensors (read-only float32, as ``FragmentCodec.decode`` gives), decoded on first use."""
        if self._values is None:
            if self._source is None:
                raise ValueError("coded upload: cleared, its values are gone")
            flats, _ = pack.unpack(self.fmt, self._source, self.sizes, self._workers)
            self._values = {}
            for n, flat in zip(self._names, flats):
                a = flat.reshape(self.shapes[n])
                a.flags.writeable = False
                self._values[n] = a
        return self._values

    def clear(self) -> None:
        self._source = self._scales = self._values = None

    def fold_into(self, sums: Sequence[np.ndarray], keep: np.ndarray, k: np.ndarray, workers: Workers) -> None:
        """For each tensor t with k[t] ≠ 0: sums[t] ← sums[t]·keep[t] + x·k[t] (sums[t] ← x·k[t] where keep[t]
        is 0), x its decoded values (``merge._scaled_add``'s arithmetic, float32; flat sums of its size)."""
        if self._source is None:
            raise ValueError("coded upload: cleared, nothing to fold")
        fmt, sizes, geo = self.fmt, self.sizes, self._geo
        lo, hi = blocks.nibble_levels(fmt.codebook) if fmt.bits == 4 else (None, None)
        raw, scales, bs = self._source.raw, self._scales, fmt.block_size

        def run(it) -> None:
            t, a, b, c = it
            if k[t] == 0:
                return
            codes = geo.codes(raw[c], c)
            g, start = geo.starts[t] + a - geo.first(c), a * bs
            s = sums[t][start:min(sizes[t], b * bs)]
            kp, kk = np.float32(keep[t]), np.float32(k[t])
            if fmt.bits == 4:
                kernels.fold4(codes[g:g + b - a], scales[c][g:g + b - a], lo, hi, s, kp, kk)
            else:
                kernels.fold8(codes[g:g + b - a].view(np.int8), scales[c][g:g + b - a], s, kp, kk)

        workers.map(run, geo.items)


class _Geometry:
    """Where a fragment's blocks lie: each tensor's first block, the work items (``chunks.block_items``)
    and a chunk's codes within its raw bytes."""

    def __init__(self, fmt: Format, sizes: Sequence[int]):
        self.bs, self.cb = fmt.block_size, code_bytes_per_block(fmt.bits, fmt.block_size)
        self.per_chunk_blocks = chunks.chunk_blocks(fmt)
        self.starts, first = [], 0
        for n in sizes:
            self.starts.append(first)
            first += n_blocks(n, self.bs)
        self.items = chunks.block_items(sizes, fmt)

    def first(self, c: int) -> int:
        return c * self.per_chunk_blocks

    def codes(self, raw: np.ndarray, c: int) -> np.ndarray:
        m = raw.size // (2 + self.cb)
        return raw[2 * m:].reshape(m, self.cb)


def scan(fmt: Format, source, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]], sizes: Sequence[int],
         workers: Workers) -> Coded:
    """The ``Coded`` of a fragment's raw bytes read a chunk at a time from ``source`` (``entropy.Chunks``
    or ``pack.Whole``), on ``workers``: each chunk decompressed into one pooled buffer (a chunk stored
    raw stays a view of the payload) and its scales checked (CodecError, as ``decode``); then Σx² per
    tensor summed as ``merge.sum_squares`` sums it (its items, each dequantized into this thread's
    scratch), so a merge's RDA norms are the bits it would compute from the values."""
    geo = _Geometry(fmt, sizes)
    total = sum(ln for _, ln in source.spans) if not isinstance(source, pack.Whole) else 0
    store = RAW.empty(-(-total // 4)).view(np.uint8)[:total]  # stored raw: nothing to copy
    raw: list[np.ndarray | None] = [None] * len(source.spans)
    scales: list[np.ndarray | None] = [None] * len(source.spans)

    def read(c: int) -> None:
        off, ln = source.spans[c]
        got = np.frombuffer(source.read(c, store[off:off + ln]), np.uint8)
        raw[c] = got  # the store's or a view of the payload (a chunk stored raw, or no zstd)
        scales[c] = pack.chunk_scales(got, geo.cb, fmt, geo.first(c))

    workers.map(read, list(range(len(source.spans))))
    bs, per = geo.bs, geo.per_chunk_blocks
    items = merge_chunks(sizes)

    def sum_item(it) -> float:
        t, a, b = it
        lo, hi = a // bs, -(-b // bs)  # the tensor's blocks holding values [a, b): a is a block boundary
        x = thread_scratch((hi - lo) * bs).reshape(hi - lo, bs)
        g = geo.starts[t] + lo
        while lo < hi:  # the blocks of each zstd chunk they lie in
            c = g // per
            k = min(hi - lo, (c + 1) * per - g)
            i = g - geo.first(c)
            blocks.dequantize_into(geo.codes(raw[c], c)[i:i + k], scales[c][i:i + k], fmt,
                                   x[lo - a // bs:lo - a // bs + k])
            lo, g = lo + k, g + k
        return chunk_sum_squares(x.reshape(-1)[:b - a])

    sq = per_tensor(len(sizes), items, workers.map(sum_item, items))
    return Coded(names, shapes, fmt, sizes, _Stored(raw, source.spans), scales, sq, workers, geo)


class _Overflow(Exception):
    """base + decoded values of tensor ``t`` overflow float32 (``add_decoded``'s checking pass)."""

    def __init__(self, t: int):
        self.t = t


def add_decoded(fmt: Format, source, names: Sequence[str], sizes: Sequence[int], workers: Workers,
                base: Sequence[np.ndarray], out: Sequence[np.ndarray], bound_ok=None) -> None:
    """out[t] ← base[t] + the decoded values of tensor t (flat float32 arrays of ``sizes``; out may be base),
    one work item at a time on ``workers`` (``kernels.add_decoded4`` / ``add_decoded8``: the bits of decoding
    then ``numpy.add``). Where ``bound_ok(b)`` is False for b, the largest |value| the scales allow, a pass
    that writes nothing first checks every sum: NonFiniteError if one overflows, and ``out`` untouched."""
    geo = _Geometry(fmt, sizes)
    raw = [np.frombuffer(source.read(c), np.uint8) for c in range(len(source.spans))]
    scales = workers.map(lambda c: pack.chunk_scales(raw[c], geo.cb, fmt, geo.first(c)), list(range(len(raw))))
    level = INT4_QMAX if fmt.bits == 4 else INT8_QMAX  # every codebook's levels lie in [-1, 1] x qmax
    top = max((float(s.max()) for s in scales if s.size), default=0.0) * level
    lo_tab, hi_tab = blocks.nibble_levels(fmt.codebook) if fmt.bits == 4 else (None, None)
    bs = geo.bs

    def piece(it):
        t, a, b, c = it
        g = geo.starts[t] + a - geo.first(c)
        return t, a * bs, min(sizes[t], b * bs), geo.codes(raw[c], c)[g:g + b - a], scales[c][g:g + b - a]

    def check(it) -> None:
        t, lo, hi, codes, sc = piece(it)
        x = thread_scratch(codes.shape[0] * bs).reshape(-1, bs)
        blocks.dequantize_into(codes, sc, fmt, x)
        y = x.reshape(-1)[:hi - lo]
        with np.errstate(over="ignore", invalid="ignore"):
            np.add(base[t][lo:hi], y, out=y)
        if not np.isfinite(y).all():
            raise _Overflow(t)

    def run(it) -> None:
        t, lo, hi, codes, sc = piece(it)
        if fmt.bits == 4:
            kernels.add_decoded4(codes, sc, lo_tab, hi_tab, base[t][lo:hi], out[t][lo:hi])
        else:
            kernels.add_decoded8(codes.view(np.int8), sc, base[t][lo:hi], out[t][lo:hi])

    if bound_ok is not None and not bound_ok(top):
        try:
            workers.map(check, geo.items)
        except _Overflow as e:
            raise NonFiniteError(f"tensor {names[e.t]!r}: adding its decoded values to the base overflows float32 "
                                 "(non-finite result)") from None
    workers.map(run, geo.items)
