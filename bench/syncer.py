#!/usr/bin/env python
"""Syncer throughput: how many learner fragments S syncer shards decode, merge, step and re-encode.

Two measurements (issue #15):

1. In process (``inprocess``): one ``SyncerCore`` over two fragments of the layout, fed M
   pre-encoded int4 payloads (random normal outer gradients, one per learner) per round;
   every stage of the syncer's hot path is timed with ``time.perf_counter`` (wall) and
   ``time.process_time`` (CPU of the whole process): decode (int4 + zstd), validate (shape,
   NaN and norm checks), merge (token-weighted RDA), outer (the Nesterov step, numpy in place, + applying
   it to Θ), encode (the update, int4 + zstd). Medians over repeats.
2. End to end over loopback (``rows``): S shards, each the runtime's ``SyncerService`` of
   its fragments (``wan_diloco.shards.owners``) behind a ``TransportServer`` in its own
   process, and M learner processes that upload pre-encoded
   int4 fragments of every fragment in turn as fast as the protocol lets them (a fragment's
   next Δ goes once the learner has its previous update; two uploads in flight per learner),
   subscribed to the broadcasts. No training. The syncer's stages are timed the same way,
   through the core's timing hook (``SyncerCore.timing``, ``TIMED_STAGES``) and the service's
   codec (decode), on the run's own ``Assembly``; transport is the rest of the syncer process's CPU. Round latency: from the moment the syncer's handler got
   the round's last contribution to the moment the last learner had the broadcast.

From these, the largest model x M x per-learner link rate one shard keeps up with
(``ceiling``, formulas in ``ceiling.formula``) and a ``planner`` block. Writes
bench/results/syncer.json and syncer.png.

    python -m bench.syncer [--quick]        # or: python bench/syncer.py [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import mmap
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

OUT = ROOT / "bench" / "results"
TOKEN = "bench-syncer-token-not-secret"
THETA0 = 0.01  # Θ's value everywhere: the cost of every stage is independent of the values
DELTA_STD = 1e-4  # per-element std of the synthetic outer gradients (norms well inside max_delta_ratio)
TOKENS_PER_STEP = 4096
UPLOADS_IN_FLIGHT = 2  # per learner: the next fragment is on the wire while the syncer works on this one
GB = 1e9
STREAM_IDLE_TIMEOUT_S = [600.0]  # the syncer's; set from --idle-timeout-s

# Layouts: real tensor names and shapes of the built-in transformer, split by the run's default
# ("balanced") fragmenter. "1b": 24 blocks like the planner's 1b preset, a 32k vocabulary.
LAYOUTS = {
    "1b": dict(vocab_size=32768, d_model=1792, n_layers=24, n_heads=14, d_ff=7168, seq_len=2048),
    "base": "base",  # the 99.5M preset
    "small": "small",  # 10.8M
    "tiny": "tiny",  # 0.86M
}


# ---- layout, codec, payloads ---------------------------------------------------------------

def model_config(name: str):
    from wan_diloco import model as model_lib
    spec = LAYOUTS[name]
    return model_lib.preset(spec) if isinstance(spec, str) else model_lib.ModelConfig(**spec)


def build_layout(name: str, num_fragments: int):
    """The Layout of layout ``name`` in ``num_fragments`` fragments (shapes only: nothing allocated)."""
    from wan_diloco import model as model_lib, tree
    from wan_diloco.fragments import Layout, make_fragments
    shapes = {n: tuple(a.shape) for n, a in tree.flatten(model_lib.abstract_params(model_config(name))).items()}
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    return Layout(make_fragments("balanced", sizes, num_fragments, model_lib.layer_index), shapes)


def wire_codec(layout, workers=None):
    """The codec under test: int4 (NF4, 256-value blocks, bf16 scales) + zstd, the project defaults at 4 bits;
    ``workers``: its threads (default one)."""
    from wan_diloco.compression import CodecConfig, FragmentCodec
    from wan_diloco.merge import SERIAL
    return FragmentCodec(CodecConfig(bits=4), layout, workers or SERIAL)


def random_delta(layout, p: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for n in layout.fragments[p]:
        x = rng.standard_normal(math.prod(layout.shapes[n]), dtype=np.float32)
        x *= DELTA_STD
        out[n] = x.reshape(layout.shapes[n])
    return out


def theta0(layout) -> dict[str, np.ndarray]:
    """Θ(0) as read-only broadcast views (no memory until the core copies them)."""
    return {n: np.broadcast_to(np.float32(THETA0), s) for n, s in layout.shapes.items()}


def shard_owners(layout, shards: int) -> list[int]:
    """Which shard owns each fragment: the run's own plan (balanced by bytes)."""
    from wan_diloco import shards as shards_lib
    return shards_lib.owners(layout.nbytes, shards)


# ---- stage timing -----------------------------------------------------------------------------

class Stages:
    """Wall and CPU seconds (``process_time``: every thread of this process) per named stage; a stage
    entered inside "close" also counts as "close/<name>" (the merge both folds each arriving Δ and
    finishes at the close)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.open: list[str] = []

    @contextlib.contextmanager
    def time(self, name: str):
        names = [name, f"close/{name}"] if "close" in self.open else [name]
        self.open.append(name)
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.open.pop()
            for n in names:
                self.wall[n] = self.wall.get(n, 0.0) + time.perf_counter() - w
                self.cpu[n] = self.cpu.get(n, 0.0) + time.process_time() - c
                self.calls[n] = self.calls.get(n, 0) + 1

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.time(name):
                return fn(*args, **kwargs)
        return timed

    def snapshot(self) -> dict:
        return {"wall": dict(self.wall), "cpu": dict(self.cpu), "calls": dict(self.calls)}


def split_of(cpu: dict[str, float], total_cpu: float | None = None) -> dict[str, float]:
    """The five-way split (seconds) from stage seconds: decode holds the checks of an upload (validate),
    outer holds applying the step to Θ; transport is the rest of ``total_cpu`` (None: not measured)."""
    g = lambda k: cpu.get(k, 0.0)  # noqa: E731
    merge, encode = g("merge"), g("encode")
    split = {"decode": g("decode") + g("validate_upload") + g("validate_norm"), "merge": merge,
             "outer": max(0.0, g("close") - g("close/merge") - encode), "encode": encode}
    split["transport"] = max(0.0, total_cpu - sum(split.values())) if total_cpu is not None else 0.0
    return {k: split[k] for k in ("transport", "decode", "merge", "outer", "encode")}


def detail_of(cpu: dict[str, float]) -> dict[str, float]:
    g = lambda k: cpu.get(k, 0.0)  # noqa: E731
    return {"decode": g("decode"), "validate": g("validate_upload") + g("validate_norm"),
            "validate_norm": g("validate_norm"), "merge": g("merge"), "outer_step": g("outer_step"),
            "apply_and_bookkeeping": max(0.0, g("close") - g("close/merge") - g("encode") - g("outer_step")),
            "encode": g("encode")}


# ---- 1. in process ---------------------------------------------------------------------------

def sample_fragments(layout) -> list[int]:
    """Two fragments to time: the one holding the input embedding (merged by plain mean) and a middle
    one (RDA); the full-model figure weights them by the bytes they stand for."""
    from wan_diloco import model as model_lib
    emb = next((p for p, f in enumerate(layout.fragments) if any(model_lib.is_embedding(n) for n in f)), 0)
    mid = len(layout.fragments) // 2
    if mid == emb:
        mid = (mid + 1) % len(layout.fragments)
    return [emb] if mid == emb else [emb, mid]


def inprocess(layout, learners: list[int], reps: int, log, threads: list[int] = (1,),
              on_row=lambda rows: None) -> tuple[list[dict], dict]:
    """Per syncer thread count, sampled fragment and M: median stage times of one round (M uploads
    decoded and merged; ``on_row(rows)`` after each); and the hot path against memcpy and a round's
    peak memory (``syncer_hotpath``)."""
    from bench import syncer_hotpath as hotpath
    from wan_diloco import model as model_lib
    from wan_diloco.clock import VectorClock
    from wan_diloco.core import FragmentUpload, SyncerConfig, SyncerCore
    from wan_diloco.fragments import Layout

    sample = sample_fragments(layout)
    sub = Layout([layout.fragments[p] for p in sample], layout.shapes)
    codec = wire_codec(sub)
    m_max = max(learners)
    payloads = {}
    for i, p in enumerate(sample):
        payloads[i] = [codec.encode(random_delta(sub, i, seed=1000 * p + m)) for m in range(m_max)]
        log(f"inprocess: fragment {p}: {sub.nbytes[i] / 1e6:.0f} MB fp32, {len(sub.fragments[i])} tensors, "
            f"payload {len(payloads[i][0]) / 1e6:.1f} MB")
    rows = []
    for T, M in itertools.product(threads, learners):
        cfg = SyncerConfig(num_learners=M, quorum=M, grace=False, liveness_timeout_s=1e6, threads=T)
        core = SyncerCore(cfg, sub.fragments, theta0(sub), model_lib.is_embedding, wire_codec(sub))
        for i, p in enumerate(sample):
            per_rep = []
            for rep in range(reps + 1):  # the first is a warm-up
                stages = Stages()  # fresh accumulators for every repeat
                core.timing = stages.time  # the core's public timing hook (TIMED_STAGES)
                decode = stages.wrap("decode", core.codec.decode)
                version = core.version[i]
                w0, c0, ru0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
                out = []
                for m in range(M):
                    delta = decode(i, payloads[i][m], deferred=True)  # as the runtime's serde: kept in its codes
                    delta.handed_over = True  # as the runtime's serde: the core drops it once folded
                    up = FragmentUpload(learner=m, fragment=i, due_step=rep + 1, base_version=version,
                                        c_steps=8, c_tokens=8 * TOKENS_PER_STEP * (1 + m % 3),
                                        clock=VectorClock({f"learner-{m}": rep + 1}), delta=delta,
                                        nbytes=len(payloads[i][m]))
                    out = core.on_fragment(float(rep), up)
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                sys_s = ru1.ru_stime - ru0.ru_stime
                sys_share = sys_s / max(1e-9, sys_s + ru1.ru_utime - ru0.ru_utime)
                assert len(out) == 1 and core.version[i] == version + 1, "the round did not close"
                if rep:
                    per_rep.append({"wall_s": wall, "cpu_s": cpu, "sys_share": sys_share, "stages": stages.snapshot()})
            med = lambda xs: statistics.median(xs)  # noqa: E731
            names = sorted({k for r in per_rep for k in r["stages"]["cpu"]})
            cpu_stage = {k: med([r["stages"]["cpu"].get(k, 0.0) for r in per_rep]) for k in names}
            wall_stage = {k: med([r["stages"]["wall"].get(k, 0.0) for r in per_rep]) for k in names}
            merged = M * sub.nbytes[i]
            row = {
                "threads": T, "fragment": p, "learners": M, "fragment_fp32_bytes": sub.nbytes[i],
                "tensors": len(sub.fragments[i]), "payload_bytes": len(payloads[i][0]),
                "embedding": any(model_lib.is_embedding(n) for n in sub.fragments[i]),
                "round_wall_ms": 1e3 * med([r["wall_s"] for r in per_rep]),
                "round_cpu_ms": 1e3 * med([r["cpu_s"] for r in per_rep]),
                "sys_share": med([r["sys_share"] for r in per_rep]),
                "stage_wall_ms": {k: 1e3 * v for k, v in split_of(wall_stage).items() if k != "transport"},
                "stage_cpu_ms": {k: 1e3 * v for k, v in split_of(cpu_stage).items() if k != "transport"},
                "detail_cpu_ms": {k: 1e3 * v for k, v in detail_of(cpu_stage).items()},
                "per_learner_cpu_ms": {"decode": 1e3 * split_of(cpu_stage)["decode"] / M,
                                       "merge": 1e3 * cpu_stage.get("merge", 0.0) / M},
                "cpu_s_per_gb": {k: v / (merged / GB) for k, v in split_of(cpu_stage).items()},
                "merged_gb_s": merged / GB / med([r["wall_s"] for r in per_rep]),
                "merged_gb_s_per_core": merged / GB / med([r["cpu_s"] for r in per_rep]),
                "reps": reps,
            }
            rows.append(row)
            on_row(rows)
            log(f"inprocess: threads={T} M={M} fragment {p}: round {row['round_wall_ms']:.0f} ms wall, "
                f"{row['round_cpu_ms']:.0f} ms CPU; CPU ms " + ", ".join(
                    f"{k} {v:.0f}" for k, v in row["stage_cpu_ms"].items()))
        del core

    i = next((j for j in range(len(sample)) if not rows[j]["embedding"]), 0)  # the RDA fragment
    from wan_diloco.merge import Workers
    top = max(threads)
    refs = hotpath.references(wire_codec(sub, Workers(top)), i, payloads[i][0], sub.nbytes[i], reps=max(3, reps))
    log("inprocess: CPU s per GB: np.copy {np_copy:.3f}, codec decode (1 thread) {codec_decode_1_thread:.3f}, "
        "zstd alone {zstd_decompress:.3f}".format(**refs) +
        f"; codec decode wall, 1 thread / {top}: {refs[f'codec_decode_wall_1_vs_{top}_threads']:.2f}" +
        ("" if top == 1 else f"; memory-bound passes, 1 thread / {top}: copy "
         f"{refs[f'np_copy_wall_1_vs_{top}_threads']:.2f}, fold {refs[f'fold_wall_1_vs_{top}_threads']:.2f}"))

    def make_core(M):
        cfg = SyncerConfig(num_learners=M, quorum=M, grace=False, liveness_timeout_s=1e6, threads=max(threads))
        return SyncerCore(cfg, sub.fragments, theta0(sub), model_lib.is_embedding, wire_codec(sub))

    def upload_of(core, m, rep):
        delta = core.codec.decode(i, payloads[i][m], deferred=True)
        delta.handed_over = True  # as the runtime's serde
        return FragmentUpload(learner=m, fragment=i, due_step=rep + 1, base_version=core.version[i], c_steps=8,
                              c_tokens=8 * TOKENS_PER_STEP, clock=VectorClock({f"learner-{m}": rep + 1}),
                              delta=delta, nbytes=len(payloads[i][m]))

    memory = hotpath.round_memory(make_core, upload_of, sub.nbytes[i], learners)
    log("inprocess: a round's peak memory above Θ + momentum, in fragments: " + ", ".join(
        f"{m} {v['fragments']:.2f} (while Δs arrive {v['while_deltas_arrive_fragments']:.2f}, the closing upload "
        f"{v['closing_upload_fragments']:.2f})" for m, v in memory.items()))
    return rows, {"per_stage_cpu_s_per_gb": hotpath.per_stage(rows, refs), "round_memory_fragments": memory}


def inprocess_summary(layout, rows: list[dict]) -> dict[int, dict]:
    """Per M: CPU seconds per GB merged, each stage, for the whole model (the embedding fragment
    weighted by its bytes, the middle one standing for every other fragment)."""
    total = sum(layout.nbytes)
    out = {}
    most = max(r["threads"] for r in rows)
    for M in sorted({r["learners"] for r in rows}):
        rs = [r for r in rows if r["learners"] == M and r["threads"] == most]
        emb = [r for r in rs if r["embedding"]]
        rest = [r for r in rs if not r["embedding"]]
        if emb and rest:  # the embedding fragment for its bytes, the other sample for every other fragment
            w = emb[0]["fragment_fp32_bytes"] / total
            mix = lambda get: w * get(emb[0]) + (1 - w) * get(rest[0])  # noqa: E731
        else:
            mix = lambda get: get((emb or rest)[0])  # noqa: E731
        split = {k: mix(lambda r, k=k: r["cpu_s_per_gb"][k])
                 for k in ("transport", "decode", "merge", "outer", "encode")}
        out[M] = {"cpu_s_per_gb": split, "merged_gb_s_per_core": 1.0 / max(1e-12, sum(split.values())),
                  "merged_gb_s": mix(lambda r: r["merged_gb_s"])}
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- 2. end to end: the syncer process ---------------------------------------------------------

def run_spec(layout_name: str, learners: int, fragments: int, shards: int = 1):
    from wan_diloco import spec as spec_lib
    model = LAYOUTS[layout_name]
    seq_len = model_config(layout_name).seq_len
    return spec_lib.from_document({
        # The learners' steps are of TOKENS_PER_STEP tokens (the syncer refuses more per step), and the step
        # budget is out of reach: the measurement ends on time, not on a final sync.
        "run": {"learners": learners, "token": TOKEN, "status_port": -1, "tick_s": 1.0, "run_id": "bench-syncer",
                "steps": 10**9, "batch_size": TOKENS_PER_STEP // seq_len},
        "model": {"preset": model} if isinstance(model, str) else model,
        "learner": {"num_fragments": fragments, "sync_every": 4 * fragments, "tau": 1},
        # K = M, no grace: a round closes on its M-th contribution, all of them merged.
        # The learners send fragments only, no step reports: the pace bound would stop them at step_slack.
        "syncer": {"quorum": learners, "grace": False, "liveness_timeout_s": 600.0, "shards": shards,
                   "step_slack": 10**9},
        "codec": {"bits": 4},
        # Long deadlines: a queued upload waits for the syncer's loop, which is the point here. The default
        # stream_idle_timeout_s (30 s) could abort an upload whose chunks the busy loop does not read in time
        # (suspected in one run at M = 8 on the 1b layout: docs/benchmarks.md); ``--idle-timeout-s 30``
        # measures with it. Failed uploads are retried and counted either way.
        "transport": {"call_timeout_s": 300.0, "stream_idle_timeout_s": STREAM_IDLE_TIMEOUT_S[0]},
    })


def bench_parts(spec, layout):
    """The run's ``Assembly`` with Θ(0) as broadcast views of the synthetic layout instead of a built model:
    every part the syncer takes (layout, codecs, shard plan, fingerprint, its core) follows from it as in a run."""
    from wan_diloco.assemble import Assembly
    parts = Assembly(spec)
    parts.flat0 = theta0(layout)  # takes the place of the cached property: no model is initialised
    assert parts.layout.fragments == layout.fragments and parts.codec.cfg == wire_codec(layout).cfg
    return parts


async def serve_syncer(args: dict) -> None:
    """One syncer shard: SyncerService behind TransportServer; reports one measurement window."""
    from wan_diloco.runtime.syncer import SyncerService
    from wan_diloco.transport import TransportMetrics, TransportServer

    t0 = time.perf_counter()
    STREAM_IDLE_TIMEOUT_S[0] = args["idle_timeout_s"]
    layout = build_layout(args["layout"], args["fragments"])
    spec = run_spec(args["layout"], args["learners"], args["fragments"], args["shards"])
    if args.get("direct_port"):  # striped uploads over plain connections (transport/direct.py), not gRPC
        spec = spec.with_changes(transport={"direct_port": args["direct_port"]})
    rss0 = rss_bytes()  # before Θ and the outer state exist
    metrics = TransportMetrics()
    service = SyncerService(spec, metrics, parts=bench_parts(spec, layout), shard=args["shard"])
    core = service.core
    stages = Stages()
    core.timing = stages.time  # the core's public timing hook (TIMED_STAGES)
    service.codec.decode = stages.wrap("decode", service.codec.decode)  # the service decodes each upload
    setup_s = time.perf_counter() - t0
    server = TransportServer(service, TOKEN, spec.transport, "127.0.0.1:0", metrics, name="syncer")
    port = await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()

    # Each shard measures its share of the rounds (its fragments' share of P), so windows overlap.
    share = len(core.owned) / args["fragments"]
    warmup = max(1, math.ceil(args["warmup_rounds"] * share))
    measure, max_s = max(1, math.ceil(args["measure_rounds"] * share)), args["max_seconds"]
    state = {"A": None, "done": False, "merged_bytes": 0, "uploads": 0, "rounds": [], "publish": {}}
    seen = [0]  # history entries handled

    def snap() -> dict:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"t": time.monotonic(), "cpu_s": time.process_time(), "rss_max_kib": ru.ru_maxrss,
                "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "minor_faults": ru.ru_minflt,
                "bytes_in": metrics.total(metrics.bytes_in), "bytes_out": metrics.total(metrics.bytes_out),
                "direct_bytes_in": metrics.total(metrics.bytes_in, "Direct"),
                "rounds": sum(core.stats.fragment_syncs), "uploads": state["uploads"],
                "merged_bytes": state["merged_bytes"], "stages": stages.snapshot(),
                "errors": {f"{x.labels['rpc']}/{x.labels['code']}": x.value for c in metrics.errors.collect()
                           for x in c.samples if x.name.endswith("_total")}}

    original_publish = service.hub.publish

    def publish(frame, to=None):
        if to is None and isinstance(frame.meta, dict) and "to_version" in frame.meta:
            state["publish"][(frame.fragment, frame.meta["to_version"])] = time.monotonic()
        return original_publish(frame, to)
    service.hub.publish = publish

    original = service.on_fragment

    async def on_fragment(frame):
        t_in = time.monotonic()
        with stages.time("handler"):
            ack = await original(frame)
        hist = list(core.stats.history)
        new = sum(core.stats.fragment_syncs) - seen[0]
        for _, p, _, learners in hist[len(hist) - new:] if new else ():
            state["uploads"] += len(learners)
            state["merged_bytes"] += len(learners) * layout.nbytes[p]
            v = core.version[p]
            if state["A"] is not None and not state["done"]:
                state["rounds"].append([p, v, len(learners), t_in, state["publish"].get((p, v))])
        seen[0] += new
        n = seen[0]
        if state["A"] is None and n >= warmup:
            state["A"] = snap()
        elif state["A"] is not None and not state["done"]:
            a = state["A"]
            if n - a["rounds"] >= measure or (time.monotonic() - a["t"] >= max_s and n - a["rounds"] >= 1):
                state["done"] = True
                print(json.dumps({"result": {"A": a, "B": snap(), "rounds": state["rounds"], "setup_s": setup_s,
                                             "rss_before_state_bytes": rss0,
                                             "layout_bytes": sum(layout.nbytes)}}), flush=True)
        return ack
    service.on_fragment = on_fragment

    print(json.dumps({"port": port, "setup_s": setup_s}), flush=True)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), spec.run.tick_s)
            except asyncio.TimeoutError:
                service.tick()
    finally:
        service.stopping = True
        await server.stop(0.5)


# ---- 2. end to end: a synthetic learner process ---------------------------------------------

async def serve_learner(args: dict) -> None:
    """Upload pre-encoded fragments in schedule order as fast as the protocol allows; log what arrives."""
    from wan_diloco.clock import VectorClock
    from wan_diloco.core import FragmentUpload
    from wan_diloco.runtime import serde
    from wan_diloco.transport import SyncerClient, TransportConfig, TransportError

    m, P, index = args["learner"], args["fragments"], args["index"]
    with open(args["payloads"], "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    versions = [0] * P
    changed = asyncio.Condition()
    ready = asyncio.Event()
    identities = set()
    recv, sent, errors, ticks = [], [], [], itertools.count(1)
    config = TransportConfig(call_timeout_s=300.0)
    if args.get("stripe_min_bytes"):
        config = dataclasses.replace(config, stripe_min_bytes=args["stripe_min_bytes"])
    targets = args["targets"]  # one per shard; fragment p goes to targets[owners[p]]
    owners = args["owners"]
    ports = args.get("direct_ports") or [0] * len(targets)  # direct stripes to each shard's own port
    clients = [SyncerClient(t, TOKEN, dataclasses.replace(config, direct_port=d)) for t, d in zip(targets, ports)]
    for c in clients:
        await c.connect()
    me = f"learner-{m}"

    async def listen(s, client):
        async for frame in client.subscribe(me, "bench"):
            meta = frame.meta
            if not (isinstance(meta, dict) and "to_version" in meta):
                identities.add(s)  # the Identity frame: this learner's mailbox on shard s exists now
                if len(identities) == len(clients):
                    ready.set()
                continue
            recv.append([frame.fragment, meta["to_version"], time.monotonic()])
            async with changed:
                versions[frame.fragment] = max(versions[frame.fragment], meta["to_version"])
                changed.notify_all()

    schedule = ((c, p) for c in itertools.count() for p in range(P))

    async def worker():
        for c, p in schedule:
            async with changed:
                await changed.wait_for(lambda: versions[p] >= c)
            off, n = index[p]
            up = FragmentUpload(learner=m, fragment=p, due_step=c * P + p + 1, base_version=versions[p],
                                c_steps=4 * P, c_tokens=4 * P * TOKENS_PER_STEP,
                                clock=VectorClock({me: next(ticks)}), delta={}, nbytes=n, payload=view[off:off + n])
            t0 = time.monotonic()
            while True:
                try:
                    await clients[owners[p]].upload_fragment(serde.to_frame(up))
                    break
                except TransportError as e:  # counted and sent again, as a learner would
                    errors.append([p, c, time.monotonic(), str(e)[:200]])
                    await asyncio.sleep(0.5)
            sent.append([p, c, t0, time.monotonic()])

    listeners = [asyncio.ensure_future(listen(s, c)) for s, c in enumerate(clients)]
    workers = []
    try:
        await asyncio.wait_for(ready.wait(), 120)
        workers = [asyncio.ensure_future(worker()) for _ in range(UPLOADS_IN_FLIGHT)]
        done, _ = await asyncio.wait([asyncio.ensure_future(stop.wait()), *workers, *listeners],
                                     return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not stop.is_set():
                raise t.exception()
    finally:
        for t in [*workers, *listeners]:
            t.cancel()
        await asyncio.gather(*workers, *listeners, return_exceptions=True)
        for c in clients:
            await c.close()
        print(json.dumps({"learner": m, "recv": recv, "sent": sent, "errors": errors, "cpu_s": time.process_time()}),
              flush=True)


# ---- 2. end to end: the driver (this process) --------------------------------------------------

def write_payloads(layout, path: Path, log) -> tuple[list[list[int]], int]:
    """Every fragment's int4 payload of one random Δ, back to back in ``path``; (offset, length) each.
    Learners map the file: one copy in the page cache for all of them."""
    codec = wire_codec(layout)
    index, off = [], 0
    with open(path, "wb") as f:
        for p in range(len(layout.fragments)):
            data = codec.encode(random_delta(layout, p, seed=p))
            f.write(data)
            index.append([off, len(data)])
            off += len(data)
    log(f"payloads: {len(index)} fragments, {off / 1e6:.0f} MB int4 for {sum(layout.nbytes) / 1e9:.2f} GB fp32")
    return index, off


class _Proc:
    """A child process of this script, its stdout read line by line on a thread; always torn down."""

    def __init__(self, role: str, args: dict):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", role,
                                      "--role-args", json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next_json(self, timeout: float, key: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {key!r} line from pid {self.proc.pid} in {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"pid {self.proc.pid} exited ({self.proc.wait()}) before a {key!r} line")
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if key in doc:
                return doc

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_shards(shards: int, args: dict) -> list[_Proc]:
    """The syncer shards: S processes, each a SyncerService of its fragments (``shard_owners``)."""
    ports = args.get("direct_ports") or [0] * shards
    return [_Proc("syncer", {**args, "shards": shards, "shard": s, "direct_port": ports[s]}) for s in range(shards)]


def free_ports(n: int) -> list[int]:
    """``n`` different loopback ports free right now (for the shards' direct stripes)."""
    from wan_diloco.runtime.launch_cluster import free_port
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def end_to_end(layout_name: str, layout, shards: int, M: int, payloads: Path, index, opts, log) -> dict:
    P = len(layout.fragments)
    syncer_args = {"layout": layout_name, "fragments": P, "learners": M, "warmup_rounds": opts.warmup_rounds,
                   "idle_timeout_s": opts.idle_timeout_s,
                   "measure_rounds": opts.rounds or P, "max_seconds": opts.max_seconds,
                   "direct_ports": free_ports(shards) if opts.direct else None}
    t0 = time.perf_counter()
    procs: list[_Proc] = []
    try:
        syncers = start_shards(shards, syncer_args)
        procs += syncers
        hello = [s.next_json(600, "port") for s in syncers]
        log(f"e2e S={shards} M={M}: syncer ready in {max(h['setup_s'] for h in hello):.1f} s")
        targets = [f"127.0.0.1:{h['port']}" for h in hello]
        learners = [_Proc("learner", {"learner": m, "fragments": P, "index": index, "payloads": str(payloads),
                                      "targets": targets, "owners": shard_owners(layout, shards),
                                      "direct_ports": syncer_args["direct_ports"],
                                      "stripe_min_bytes": opts.stripe_min_mib << 20}) for m in range(M)]
        procs += learners
        budget = 300 + opts.max_seconds * 2 + 60 * opts.warmup_rounds
        results = [s.next_json(budget, "result")["result"] for s in syncers]
        for lp in learners:
            lp.stop(60)
        logs = [lp.next_json(30, "recv") for lp in learners]
    finally:
        for pr in procs:
            pr.stop(30)
    elapsed = time.perf_counter() - t0
    return row_of(results, logs, layout, shards, M, elapsed)


def upload_round_trips(logs: list[dict], t_from: float, t_to: float) -> list[float]:
    """Seconds from each upload's start (within [t_from, t_to]) to its learner holding the update that
    merged it (the fragment's next version): the learner's view of a round, wherever its time went (the
    upload waiting for the syncer, the merge, or the update waiting in the learner's mailbox)."""
    trips = []
    for lg in logs:
        got: dict = {}
        for p, v, t in lg["recv"]:
            got.setdefault(p, []).append((t, v))
        for p, c, t0, _ in lg["sent"]:
            if t_from <= t0 <= t_to:
                t = min((t for t, v in got.get(p, ()) if v >= c + 1 and t >= t0), default=None)
                if t is not None:
                    trips.append(t - t0)
    return trips


def fragment_cycles(logs: list[dict], t_from: float, t_to: float) -> list[float]:
    """Seconds between a learner's uploads of the same fragment in consecutive cycles (both starting within
    [t_from, t_to]): how often each fragment gets synced, the cadence the learners see."""
    cycles = []
    for lg in logs:
        starts: dict = {}
        for p, c, t0, _ in lg["sent"]:
            starts.setdefault(p, {})[c] = t0
        for by_cycle in starts.values():
            cycles += [by_cycle[c + 1] - t0 for c, t0 in by_cycle.items()
                       if c + 1 in by_cycle and t_from <= t0 and by_cycle[c + 1] <= t_to]
    return cycles


def row_of(results: list[dict], logs: list[dict], layout, shards: int, M: int, elapsed: float) -> dict:
    """The schema's row from the shards' windows and the learners' logs. The shards run at once, each
    over its own (overlapping) window: rates add up; CPU seconds add up; latencies are pooled."""
    def delta(r, key):
        return r["B"][key] - r["A"][key]

    def stage_delta(r, kind):
        a, b = r["A"]["stages"][kind], r["B"]["stages"][kind]
        return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}

    windows = [delta(r, "t") for r in results]
    rate = lambda key: sum(delta(r, key) / w for r, w in zip(results, windows))  # noqa: E731
    merged_rate = rate("merged_bytes")
    cpu = sum(delta(r, "cpu_s") for r in results)
    merged = sum(delta(r, "merged_bytes") for r in results)
    stage_cpu, stage_wall = {}, {}
    for r in results:
        for k, v in stage_delta(r, "cpu").items():
            stage_cpu[k] = stage_cpu.get(k, 0.0) + v
        for k, v in stage_delta(r, "wall").items():
            stage_wall[k] = stage_wall.get(k, 0.0) + v
    split = split_of(stage_cpu, cpu)
    got = {}
    for lg in logs:
        for p, v, t in lg["recv"]:
            got.setdefault((p, v), []).append(t)
    to_publish, to_all = [], []
    for r in results:
        for p, v, n, t_in, t_pub in r["rounds"]:
            if t_pub is not None:
                to_publish.append(t_pub - t_in)
            ts = got.get((p, v), [])
            if len(ts) == len(logs):
                to_all.append(max(ts) - t_in)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    t_from, t_to = min(r["A"]["t"] for r in results), max(r["B"]["t"] for r in results)
    trips, cycles = upload_round_trips(logs, t_from, t_to), fragment_cycles(logs, t_from, t_to)
    learner_cpu = sum(lg["cpu_s"] for lg in logs)
    sys_s = sum(delta(r, "sys_s") for r in results)
    user_s = sum(delta(r, "user_s") for r in results)
    errors: dict = {}
    for r in results:
        for k, v in r["B"]["errors"].items():
            d = v - r["A"]["errors"].get(k, 0.0)
            if d:
                errors[k] = errors.get(k, 0.0) + d
    return {
        "shards": shards, "learners": M,
        "fragments_per_s": rate("uploads"),
        "merged_gb_s": merged_rate / GB,
        "merged_gb_s_per_core": merged / GB / cpu,
        "in_gbit_s": rate("bytes_in") * 8 / 1e9,
        "direct_share_of_in": sum(delta(r, "direct_bytes_in") for r in results) / max(1, sum(delta(r, "bytes_in")
                                                                                              for r in results)),
        "out_gbit_s": rate("bytes_out") * 8 / 1e9,
        "round_latency_ms": 1e3 * pct(to_all, 50) if to_all else None,
        "cpu_split": {k: v / (merged / GB) for k, v in split.items()},
        # --- beyond the schema
        "rounds_per_s": rate("rounds"),
        "rounds": sum(delta(r, "rounds") for r in results), "uploads": sum(delta(r, "uploads") for r in results),
        "window_s": max(windows), "window_s_per_shard": windows,
        "merged_gb_s_per_shard": [delta(r, "merged_bytes") / w / GB for r, w in zip(results, windows)],
        "round_latency_ms_p90": 1e3 * pct(to_all, 90) if to_all else None,
        "upload_round_trip_ms": 1e3 * pct(trips, 50) if trips else None,
        "upload_round_trip_ms_p90": 1e3 * pct(trips, 90) if trips else None,
        "fragment_cycle_ms": 1e3 * pct(cycles, 50) if cycles else None,
        "round_latency_to_publish_ms": 1e3 * pct(to_publish, 50) if to_publish else None,
        "syncer_cpu_cores_busy": sum(delta(r, "cpu_s") / w for r, w in zip(results, windows)),
        # Kernel time (page faults and zeroing of freshly allocated arrays, mostly) over all CPU time.
        "syncer_sys_share": sys_s / max(1e-9, sys_s + user_s),
        "learners_cpu_cores_busy": None,  # filled below (their whole life, not the window)
        "learners_cpu_s": learner_cpu,
        "cpu_detail_s_per_gb": {k: v / (merged / GB) for k, v in detail_of(stage_cpu).items()},
        "loop_wall_share": {k: v / sum(windows) for k, v in split_of(stage_wall, None).items() if k != "transport"}
        | {"handler": stage_wall.get("handler", 0.0) / sum(windows)},
        "syncer_rss_max_gib": sum(r["B"]["rss_max_kib"] for r in results) / 2**20,
        "syncer_rss_growth_gib": sum(r["B"]["rss_max_kib"] * 1024 - r["rss_before_state_bytes"]
                                     for r in results) / 2**30,
        "syncer_setup_s": max(r["setup_s"] for r in results),
        "contributors_per_round": sorted({n for r in results for _, _, n, _, _ in r["rounds"]}),
        "syncer_transport_errors": errors,
        "learner_upload_errors": sum(len(lg["errors"]) for lg in logs),
        "learner_upload_error_examples": [e[3] for lg in logs for e in lg["errors"]][:3],
        "elapsed_s": elapsed,
    }


# ---- 3. the ceiling ------------------------------------------------------------------------

def ceiling(rows: list[dict], wire_bytes_per_param: float, state_bytes_per_param: float | None) -> dict:
    """What one shard keeps up with, from each measured M (see ``formula``)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    presets = {"1b": 0.1, "10b": 0.8}  # planner presets' step time (s), wan_diloco.planning.bandwidth
    per_m = []
    for r in rows:
        M, C = r["learners"], r["merged_gb_s"] * GB
        wire_in = C * wire_bytes_per_param / 4 * 8 / 1e9
        entry = {"shards": r["shards"], "learners": M, "merged_gb_s": r["merged_gb_s"], "wire_in_gbit_s": wire_in,
                 "per_learner_link_gbit_s": wire_in / M,
                 "max_params": {f"H={H},step_s={T}": C * H * T / (4 * M) for H in (100, 500) for T in
                                sorted(set(presets.values()))}}
        per_m.append(entry)
    return {
        "formula": (
            "S shards keep up while M * N * 4 B / (H * T_step) <= C(S, M): every H steps they merge, for each "
            "of P fragments, M fragments of N/P parameters (fp32-equivalent), so per step M * N / H parameters; "
            "C(S, M) is merged_gb_s measured with S shards and M learners. Largest model: "
            "N_max = C(S, M) * H * T_step / (4 M). "
            "Learners that keep their links busy send L = N * b * 8 / (H * T_step) bit/s each (b = wire bytes per "
            "parameter, int4 + zstd), so the same bound in link terms is M * L <= C(M) * 8 b / 4 (wire_in_gbit_s), "
            "independent of N, H and T_step: per_learner_link_gbit_s = C(M) * 8 b / (4 M). Memory: the shard "
            "holds Θ and the outer momentum (8 B/param) plus a round's M decoded Δs."),
        "wire_bytes_per_param": wire_bytes_per_param,
        "state_bytes_per_param_measured": state_bytes_per_param,
        "max_params_by_memory": (ram / state_bytes_per_param) if state_bytes_per_param else None,
        "ram_bytes": ram,
        "per_learners": per_m,
    }


# ---- plot ----------------------------------------------------------------------------------------

def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("transport", "decode", "merge", "outer", "encode")
    colors = dict(zip(keys, ("#888888", "#3b75af", "#c0504d", "#9bbb59", "#8064a2")))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = [(f"e2e S={r['shards']} M={r['learners']}", r["cpu_split"]) for r in doc["rows"]]
    bars += [(f"in-proc M={m}", s["cpu_s_per_gb"]) for m, s in doc["inprocess_model"].items()]
    for i, (label, split) in enumerate(bars):
        bottom = 0.0
        for k in keys:
            ax1.bar(i, split[k], bottom=bottom, color=colors[k], label=k if i == 0 else None)
            bottom += split[k]
    ax1.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("syncer CPU s per GB fp32 merged")
    ax1.set_title(f"CPU split ({doc['layout']['name']}, {doc['layout']['params'] / 1e6:.0f}M params, "
                  f"P={doc['layout']['fragments']})", fontsize=9)
    ax1.legend(fontsize=8)
    shard_counts = sorted({r["shards"] for r in doc["rows"]})
    for i, M in enumerate(sorted({r["learners"] for r in doc["rows"]})):
        rs = sorted((r for r in doc["rows"] if r["learners"] == M), key=lambda r: r["shards"])
        ax2.plot([r["shards"] for r in rs], [r["merged_gb_s"] for r in rs], "o-", color=f"C{i}",
                 label=f"M={M}: merged GB/s fp32")
        ax2.plot([r["shards"] for r in rs], [r["merged_gb_s_per_core"] for r in rs], "s--", color=f"C{i}",
                 label=f"M={M}: per syncer CPU core")
    ax2.set_xlabel("syncer shards S (processes)")
    ax2.set_ylabel("GB/s fp32-equivalent merged")
    ax2.set_xticks(shard_counts)
    ax2.set_ylim(bottom=0)
    ax2.set_title(f"end to end over loopback, {doc['machine']['cpus']} CPU cores shared with the learners",
                  fontsize=9)
    ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the 99.5M 'base' layout, M = 2 and 4, short windows (< 5 min)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default=None, help="default: 1b (--quick: base)")
    p.add_argument("--fragments", type=int, default=None, help="P (default 16; --quick 8)")
    p.add_argument("--learners", default=None, help="M values, comma-separated (default 2,4,8; --quick 2,4)")
    p.add_argument("--shards", default="1,2,4", help="syncer shard counts S, comma-separated (default 1,2,4)")
    p.add_argument("--reps", type=int, default=None, help="in-process repeats per M (default 3; --quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="end-to-end rounds measured per M (default P)")
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="end-to-end window cap per M (default 120; quick 30)")
    p.add_argument("--idle-timeout-s", type=float, default=STREAM_IDLE_TIMEOUT_S[0],
                   help="the syncer's transport.stream_idle_timeout_s (the default config's is 30)")
    p.add_argument("--direct", action="store_true",
                   help="end to end: uploads as direct stripes (transport.direct_port), not through gRPC")
    p.add_argument("--stripe-min-mib", type=int, default=0,
                   help="learners' transport.stripe_min_bytes in MiB (default: the transport's, 8): an upload of at "
                        "least twice this is striped")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--skip-end-to-end", action="store_true", help="the in-process part only")
    p.add_argument("--threads", default=None,
                   help="syncer.threads values for the in-process part, comma-separated (default 1 and every core)")
    p.add_argument("--out", default=None, help="default bench/results/syncer.json (--quick: syncer_quick.json)")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--role-args", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        from wan_diloco.transport import run
        role_args = json.loads(args.role_args)
        run(serve_syncer(role_args) if args.role == "syncer" else serve_learner(role_args))
        return 0
    args.layout = args.layout or ("base" if args.quick else "1b")
    args.fragments = args.fragments or (8 if args.quick else 16)
    learners = [int(x) for x in (args.learners or ("4" if args.quick else "4,8")).split(",")]
    shard_counts = [int(x) for x in args.shards.split(",")]
    args.out = args.out or str(OUT / ("syncer_quick.json" if args.quick else "syncer.json"))
    args.reps = args.reps or (2 if args.quick else 3)
    args.max_seconds = args.max_seconds or (30.0 if args.quick else 120.0)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    layout = build_layout(args.layout, args.fragments)
    params = sum(layout.nbytes) // 4
    log(f"layout {args.layout}: {params / 1e6:.1f}M params, P={len(layout.fragments)}, "
        f"fragments {min(layout.nbytes) / 1e6:.0f}..{max(layout.nbytes) / 1e6:.0f} MB fp32")

    from wan_diloco.merge import host_cores
    threads = [int(x) for x in args.threads.split(",")] if args.threads else sorted({1, host_cores()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def partial(**parts) -> None:  # rows on disk as each finishes; the whole document replaces them at the end
        out.write_text(json.dumps({"benchmark": "syncer", "partial": True, **parts}, indent=1) + "\n")

    t1 = time.perf_counter()
    inproc, hot = ([], {}) if args.skip_inprocess else inprocess(
        layout, learners, args.reps, log, threads, on_row=lambda rows: partial(inprocess=rows))
    inproc_s = time.perf_counter() - t1
    inproc_model = inprocess_summary(layout, inproc) if inproc else {}

    t2 = time.perf_counter()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    rows, failed, wire_total = [], [], None
    with tempfile.TemporaryDirectory(prefix="wd-bench-syncer-", dir=shm) as tmp:
        payloads = Path(tmp) / "payloads.bin"
        if not args.skip_end_to_end:
            index, wire_total = write_payloads(layout, payloads, log)
        for S, M in itertools.product([] if args.skip_end_to_end else shard_counts, learners):
            partial(inprocess=inproc, **hot, rows=rows, failed_rows=failed)
            try:
                row = end_to_end(args.layout, layout, S, M, payloads, index, args, log)
            except (RuntimeError, TimeoutError) as e:  # e.g. a shard killed for memory: say so, go on
                why = str(e) + (" (SIGKILL: out of memory on this machine?)" if "exited (-9)" in str(e) else "")
                failed.append({"shards": S, "learners": M, "error": why, "ram_gib": round(
                    os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)})
                log(f"e2e S={S} M={M}: failed: {why}")
                continue
            rows.append(row)
            log(f"e2e S={S} M={M}: {row['fragments_per_s']:.2f} fragments/s, "
                f"{row['merged_gb_s']:.3f} GB/s merged ({row['merged_gb_s_per_core']:.3f} per core), "
                f"in {row['in_gbit_s']:.3f} / out {row['out_gbit_s']:.3f} Gbit/s, latency "
                f"{row['round_latency_ms'] or float('nan'):.0f} ms, upload round trip "
                f"{row['upload_round_trip_ms'] or float('nan'):.0f} ms, fragment cycle "
                f"{row['fragment_cycle_ms'] or float('nan'):.0f} ms; CPU s/GB " + ", ".join(
                    f"{k} {v:.2f}" for k, v in row["cpu_split"].items()))
    e2e_s = time.perf_counter() - t2
    for r in rows:
        r["learners_cpu_cores_busy"] = r["learners_cpu_s"] / r["elapsed_s"]
    wire_bpp = wire_total / params if wire_total else None
    # Θ + outer momentum + a round's transients: the syncer's peak RSS over what it held before building
    # its state, per parameter (the largest M's row).
    one = [r for r in rows if r["shards"] == 1]
    state_bpp = max(r["syncer_rss_growth_gib"] for r in one) * 2**30 / params if one else None
    ceil = ceiling(rows, wire_bpp, state_bpp)
    doc = {
        "benchmark": "syncer",
        "quick": args.quick,
        "uploads": "direct stripes (transport.direct_port)" if args.direct else "gRPC",
        "stripe_min_bytes": (args.stripe_min_mib << 20) or None,
        "what": "rows: end to end over loopback, S syncer shard processes (SyncerService + TransportServer) and M learner "
                "processes uploading pre-encoded int4 fragments; fragments_per_s counts learner fragments (uploads) "
                "merged, merged_gb_s their fp32-equivalent bytes (fragments x fragment fp32 size) per second, "
                "merged_gb_s_per_core the same per syncer CPU second; in/out: the syncer's transport bytes; "
                "round_latency_ms: median, syncer handler gets a round's last contribution -> the last learner has "
                "the broadcast; upload_round_trip_ms: median, a learner starts an upload -> it has the update that "
                "merged it (wherever the wait was: its upload, the merge or its mailbox); fragment_cycle_ms: median, "
                "one learner's upload of a fragment -> its upload of the same fragment in the next cycle; "
                "cpu_split: syncer CPU seconds per GB fp32 merged (decode includes the upload checks, "
                "outer includes applying the step to Θ, transport is the rest of the process's CPU: gRPC, "
                "reassembly, serde, fan-out). inprocess: the same stages on SyncerCore alone, per round.",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "ram_gib": round(ceil["ram_bytes"] / 2**30, 1)},
        "layout": {"name": args.layout, "params": params, "fragments": len(layout.fragments),
                   "fragment_fp32_bytes": list(layout.nbytes), "tensors": len(layout.shapes),
                   "model": dataclasses.asdict(model_config(args.layout))},
        "codec": {"bits": 4, "codebook": "nf4", "block_size": 256, "zstd": True,
                  "wire_bytes_per_param": wire_bpp},
        "settings": {"learners": learners, "shards": [] if args.skip_end_to_end else shard_counts,
                     "inprocess_threads": threads, "reps": args.reps,
                     "warmup_rounds": args.warmup_rounds, "rounds": args.rounds or len(layout.fragments),
                     "max_seconds": args.max_seconds, "uploads_in_flight_per_learner": UPLOADS_IN_FLIGHT,
                     "quorum": "M (no grace)", "merge": "rda", "delta_std": DELTA_STD,
                     "syncer_stream_idle_timeout_s": args.idle_timeout_s},
        "elapsed_s": {"inprocess": round(inproc_s, 1), "end_to_end": round(e2e_s, 1),
                      "total": round(time.perf_counter() - t_start, 1)},
        "rows": rows,
        "failed_rows": failed,
        "inprocess": inproc,
        "inprocess_model": {str(m): v for m, v in inproc_model.items()},
        **hot,
        "ceiling": ceil,
        "planner": {
            "merged_fp32_gb_s_one_shard_by_learners": {str(r["learners"]): r["merged_gb_s"] for r in rows
                                                        if r["shards"] == 1},
            "merged_fp32_gb_s_by_shards_and_learners": {f"S={r['shards']},M={r['learners']}": r["merged_gb_s"]
                                                        for r in rows},
            "state_bytes_per_param": state_bpp,
            "check": "M * params * 4 / (H * step_time_s) <= shards * merged_fp32_gb_s_one_shard(M) * 1e9 "
                     "(shards on separate hosts or cores; on one box, C(S, M) as measured)",
        },
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if rows:
        plot(doc, out.with_suffix(".png"))
    log(f"wrote {out} (in-process {inproc_s:.0f} s, end to end {e2e_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
