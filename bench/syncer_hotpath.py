"""The syncer's hot path against memcpy, in one run (issue #26): bench/syncer.py's in-process part calls these.

- ``references``: CPU seconds per GB (fp32-equivalent bytes) of ``np.copyto`` of the fragment into a
  reused buffer, of the codec's decode alone on one thread (zstd + NF4 lookup x scales + the sums of
  squares it now computes) and of zstd's decompression alone, on the same payload.
- ``per_stage``: the ``per_stage_cpu_s_per_gb`` block: each stage of the in-process rows per thread
  count and M, the references, and the ratios the issue asks for.
- ``round_memory``: a round's peak of Python-tracked memory (numpy reports its buffers to
  ``tracemalloc``) above what the core holds (Θ, momentum), in fragments' worth, for each M: traced from
  before the core is built (a block freed is seen only if its allocation was traced: the old Θ a close
  replaces), from an empty ``buffers.POOL``, over a first round and a second, so the pool's buffers count;
  split into the peak while Δs arrive (decode and fold) and that of the upload that closes the round
  (its decode, the merge, the outer step and the encode of the update).
"""
from __future__ import annotations

import statistics
import time
import tracemalloc

import numpy as np

GB = 1e9


def _cpu_s(fn, reps: int) -> float:
    """Median CPU seconds (this process, every thread) of ``fn()`` over ``reps`` runs after a warm-up."""
    fn()
    out = []
    for _ in range(reps):
        c = time.process_time()
        fn()
        out.append(time.process_time() - c)
    return statistics.median(out)


def _wall_s(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` runs after a warm-up."""
    fn()
    out = []
    for _ in range(reps):
        c = time.perf_counter()
        fn()
        out.append(time.perf_counter() - c)
    return statistics.median(out)


def references(codec, fragment: int, payload: bytes, fp32_bytes: int, reps: int) -> dict:
    """CPU s per GB fp32 of a copy, the codec's decode (one thread) and zstd alone, on one payload; and the
    decode's wall time on one thread over that on the codec's workers (its zstd chunks in parallel)."""
    from wan_diloco.compression import chunks, entropy, frame
    from wan_diloco.merge import SERIAL
    values = codec.decode(fragment, payload)
    src = np.concatenate([np.ravel(v) for v in values.values()])
    dst = np.empty_like(src)
    threads = codec.workers.n
    wall_all = _wall_s(lambda: codec.decode(fragment, payload), reps)
    workers, codec.workers = codec.workers, SERIAL
    try:
        decode_s = _cpu_s(lambda: codec.decode(fragment, payload), reps)
        wall_one = _wall_s(lambda: codec.decode(fragment, payload), reps)
    finally:
        codec.workers = workers
    header = frame.parse_header(memoryview(payload))
    body = memoryview(payload)[frame.HEADER_BYTES:]
    sizes = [int(np.prod(codec.layout.shapes[n])) for n in codec.layout.fragments[fragment]]
    spans = chunks.spans(header.fmt, sizes)

    def zstd_alone() -> None:  # every chunk into one scratch, as the decode does
        source = entropy.Chunks(body, spans)
        for c, (_, ln) in enumerate(spans):
            source.read(c, chunks.scratch(ln))

    zstd_s = _cpu_s(zstd_alone, reps) if header.zstd else 0.0
    copy_s = _cpu_s(lambda: np.copyto(dst, src), reps)
    per_gb = GB / fp32_bytes
    return {"np_copy": copy_s * per_gb, "codec_decode_1_thread": decode_s * per_gb,
            "zstd_decompress": zstd_s * per_gb, "fp32_bytes": fp32_bytes, "payload_bytes": len(payload),
            f"codec_decode_wall_1_vs_{threads}_threads": wall_one / wall_all,
            **memory_bound_speedups(src, dst, workers, reps)}


def memory_bound_speedups(src: np.ndarray, dst: np.ndarray, workers, reps: int) -> dict:
    """What more threads give passes that only stream memory, the ceiling of a round's speed-up on this
    host: wall time on one thread over that on ``workers`` of a copy and of a fold (``s ← s + k·x``, the
    merge's), over the same chunks the syncer's work items use."""
    from wan_diloco.merge import CHUNK, SERIAL, _scaled_add
    if workers.n == 1:
        return {}
    items = [(a, min(a + CHUNK, src.size)) for a in range(0, src.size, CHUNK)]
    k, keep = np.float32(0.5), np.float32(1)

    def copy(w):
        return lambda: w.map(lambda it: np.copyto(dst[it[0]:it[1]], src[it[0]:it[1]]), items)

    def fold(w):
        return lambda: w.map(lambda it: _scaled_add(dst[it[0]:it[1]], keep, src[it[0]:it[1]], k), items)

    return {f"np_copy_wall_1_vs_{workers.n}_threads": _wall_s(copy(SERIAL), reps) / _wall_s(copy(workers), reps),
            f"fold_wall_1_vs_{workers.n}_threads": _wall_s(fold(SERIAL), reps) / _wall_s(fold(workers), reps)}


def per_stage(rows: list[dict], refs: dict) -> dict:
    """The block the issue names: CPU s per GB merged per stage (the RDA fragment's rows; decode
    includes the upload checks), by thread count and M, with the references and their ratios."""
    out: dict = {"unit": "CPU seconds per GB of fp32-equivalent Δ merged (decoded, for the references)",
                 "references": refs, "by_threads": {}, "ratios": {}}
    rda = [r for r in rows if not r["embedding"]] or rows
    for r in rda:
        per = {k: v for k, v in r["cpu_s_per_gb"].items() if k != "transport"}
        d = r["detail_cpu_ms"]
        gb = r["learners"] * r["fragment_fp32_bytes"] / GB
        per["decode_only"] = d["decode"] / 1e3 / gb
        per["checks_only"] = d["validate"] / 1e3 / gb
        per["total"] = sum(r["cpu_s_per_gb"][k] for k in ("decode", "merge", "outer", "encode"))
        per["merged_gb_per_cpu_s"] = 1.0 / per["total"]
        per["round_wall_ms"] = r["round_wall_ms"]
        out["by_threads"].setdefault(str(r["threads"]), {})[f"M={r['learners']}"] = per
    ratios = out["ratios"]
    one = out["by_threads"].get("1", {})
    for m, per in one.items():
        ratios[f"{m}: runtime decode + checks / codec decode (1 thread)"] = per["decode"] / refs["codec_decode_1_thread"]
        ratios[f"{m}: runtime decode + checks / np.copy"] = per["decode"] / refs["np_copy"]
        for t, by_m in out["by_threads"].items():
            if t != "1" and m in by_m:
                ratios[f"{m}: round wall, {t} threads vs 1 (speed-up)"] = per["round_wall_ms"] / by_m[m]["round_wall_ms"]
    for key in ("np_copy_wall", "fold_wall"):
        for name, v in refs.items():
            if name.startswith(key):
                ratios[f"{name} (a memory-bound pass: the host's ceiling)"] = v
    ratios["codec decode / np.copy"] = refs["codec_decode_1_thread"] / refs["np_copy"]
    ratios["codec decode GB per CPU s"] = 1.0 / refs["codec_decode_1_thread"]
    return out


def round_memory(make_core, upload_of, fp32_bytes: int, learners: list[int]) -> dict:
    """Per M: the peak memory a round allocates above the core's own state (Θ, momentum), in
    fragments' worth: ``make_core(M)`` builds a core, ``upload_of(core, m, rep)`` decodes learner m's Δ
    for round ``rep`` (as the runtime does, one upload at a time) and returns its FragmentUpload."""
    from wan_diloco.buffers import POOL
    from wan_diloco.compression.coded import RAW
    out = {}
    for M in learners:
        POOL.clear()
        RAW.clear()  # an upload's raw bytes held until folded: counted from their first allocation
        tracemalloc.start()
        try:
            core = make_core(M)
            base = tracemalloc.get_traced_memory()[0]  # Θ and momentum
            arriving = closing = 0  # peaks while Δs arrive (decode + fold) and of the upload that closes
            for rep in range(2):  # the first round fills the pool and the outer state: counted too
                for m in range(M):
                    tracemalloc.reset_peak()
                    core.on_fragment(float(rep), upload_of(core, m, rep))
                    peak_m = tracemalloc.get_traced_memory()[1]
                    if m == M - 1:
                        closing = max(closing, peak_m)
                    else:
                        arriving = max(arriving, peak_m)
            peak = max(arriving, closing)
        finally:
            tracemalloc.stop()
        out[f"M={M}"] = {"peak_above_state_bytes": peak - base, "fragments": (peak - base) / fp32_bytes,
                         "while_deltas_arrive_fragments": (arriving - base) / fp32_bytes,
                         "closing_upload_fragments": (closing - base) / fp32_bytes}
        del core
    return out
